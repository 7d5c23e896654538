"""The two ends of a butterfly round's streams: a reducer's slot for one sender's parts, and a
sender's link to one reducer (owner) that returns averaged parts."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from moshpitd.allreduce.codecs import CodecError
from moshpitd.allreduce.faults import STALL_SECONDS
from moshpitd.allreduce.layout import Part
from moshpitd.allreduce.reducer import ReductionError
from moshpitd.transport.dataplane import ABORT, PART, RESULT, Channel, DataPlaneError

if TYPE_CHECKING:
    from moshpitd.allreduce.butterfly import ButterflyRound

log = logging.getLogger("moshpitd.allreduce.butterfly")

class SenderSlot:
    """Reducer side: frames from one sender."""

    def __init__(self, rnd: ButterflyRound, sender: int, channel: Channel) -> None:
        self.rnd = rnd
        self.sender = sender
        self.channel = channel
        self.expected = {p.index for p in rnd.my_parts}
        self.staging = bytearray(rnd.max_part_bytes)
        self.outbox: asyncio.Queue[int] = asyncio.Queue()

    def buffer_for(self, kind: int, part: int, length: int, aux: int) -> memoryview | None:
        if kind != PART:
            return None
        p = self.rnd.part(part)
        if p is None or part not in self.expected:
            raise DataPlaneError(f"member {self.sender} sent part {part}, not expected here")
        want = self.rnd.codec.encoded_size(p.numel, self.rnd.dtypes[p.run])
        if length != want:
            raise DataPlaneError(f"part {part}: {length} bytes, expected {want}")
        return memoryview(self.staging)[:length]

    def on_frame(self, kind: int, part: int, payload: memoryview, aux: int) -> None:
        if kind == PART:
            self.expected.discard(part)
            p = self.rnd.parts[part]
            try:
                values = self.rnd.codec.decode(payload, p.numel, self.rnd.dtypes[p.run])
                self.rnd.contribute(p, self.sender, values)
            except (ReductionError, CodecError) as exc:
                self.rnd.exclude(self.sender, str(exc), "bad_data")
                self.channel.abort(exc)
        elif kind == ABORT:
            self.rnd.exclude(self.sender, f"it aborted: {bytes(payload).decode(errors='replace')}",
                             "aborted")
        else:
            self.rnd.exclude(self.sender, f"unexpected frame kind {kind}", "protocol")
            self.channel.abort(f"unexpected frame kind {kind}")

    def on_close(self, exc: BaseException | None) -> None:
        if self.expected:
            self.rnd.exclude(self.sender, f"its stream closed ({exc or 'EOF'})", "disconnected")

    async def write_results(self) -> None:
        """Results go back in the order parts become final."""
        while True:
            index = await self.outbox.get()
            mask = self.rnd.reducer.mask(index)
            payload = self.rnd.result_payload(index) if mask else b""
            if self.rnd.fault.stall_reduce():
                await asyncio.sleep(STALL_SECONDS)
            try:
                await self.channel.send(RESULT, index, payload, aux=mask)
            except DataPlaneError:
                return  # the sender is gone; its link will report that on its side


STALL_WINDOW = 1.0  # past the deadline, a peer must show new bytes this often to be waited for


class OwnerLink:
    """Sender side: averaged parts coming back from one owner."""

    def __init__(self, rnd: ButterflyRound, owner: int, parts: list[Part]) -> None:
        self.rnd = rnd
        self.owner = owner
        self.waiting = {p.index for p in parts}
        self.total = len(parts)
        self.done = asyncio.Event()
        self.progress = asyncio.Event()  # set per result: the send window moves
        self.failure: str | None = None

    def buffer_for(self, kind: int, part: int, length: int, aux: int) -> memoryview | None:
        if kind != RESULT:
            return None
        p = self.rnd.part(part)
        if p is None or p.owner != self.owner or part not in self.waiting:
            raise DataPlaneError(f"owner {self.owner} returned part {part}, not expected")
        dtype = self.rnd.dtypes[p.run]
        want = self.rnd.codec.encoded_size(p.numel, dtype) if aux else 0
        if length != want:
            raise DataPlaneError(f"result {part}: {length} bytes, expected {want}")
        if aux and self.rnd.codec.name == "none":
            direct = self.rnd.view.region(p)
            if direct is not None:
                return direct  # straight into the trainer's buffer
        return None

    def on_frame(self, kind: int, part: int, payload: memoryview, aux: int) -> None:
        if kind == ABORT:
            self.fail(bytes(payload).decode(errors="replace"))
            return
        if kind != RESULT:
            self.fail(f"unexpected frame kind {kind}")
            return
        p = self.rnd.parts[part]
        if aux and (aux >> len(self.rnd.group.members)):
            self.fail(f"result {part} names members that do not exist")
            return
        if aux and not (self.rnd.codec.name == "none" and self.rnd.view.region(p) is not None):
            self.rnd.view.write(p, self.rnd.codec.decode(payload, p.numel, self.rnd.dtypes[p.run]))
        self.rnd.applied[part] = aux
        self.waiting.discard(part)
        if not self.waiting:
            self.done.set()
        self.progress.set()

    def in_flight(self, sent: int) -> int:
        return sent - (self.total - len(self.waiting))

    def on_close(self, exc: BaseException | None) -> None:
        if self.waiting and self.failure is None:
            self.fail(f"stream closed ({exc or 'EOF'})")
            # Closed without a word: its daemon is gone, so stop waiting for its parts too.
            self.rnd.exclude(self.owner, "its connection dropped", "disconnected")

    def fail(self, why: str) -> None:
        if self.failure is None and self.waiting:
            self.failure = why
            log.info("owner %d failed: %s; its %d remaining parts keep local values",
                     self.owner, why, len(self.waiting))
        self.done.set()
        self.progress.set()
