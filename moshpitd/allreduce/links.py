"""The two ends of a butterfly round's streams: a reducer's slot for one sender's parts, and a
sender's link to one reducer (owner) that returns averaged parts.

An owner's results are untrusted like any contribution: each is received into the link's staging
buffer, checked for NaN/Inf, and only then copied into the trainer's buffer; a non-finite one
leaves the part at our local values (mask 0). Receiving straight into the trainer's buffer would
save that copy, but a poisoned result would then have overwritten the very values we must fall
back to, and their only other copy went to that owner. (Setting our values aside as a result's
header arrives, and receiving in place, was measured and is no cheaper: the kernel writes
received bytes past the cache either way, so one part-sized read from memory stays.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from moshpitd.allreduce.codecs import CodecError
from moshpitd.allreduce.layout import Part, all_finite
from moshpitd.allreduce.reducer import ArrayPool, ReductionError
from moshpitd.transport.dataplane import (
    ABORT,
    BAD_VALUES,
    PART,
    READY,
    RESULT,
    Channel,
    DataPlaneError,
)

if TYPE_CHECKING:
    from moshpitd.allreduce.butterfly import ButterflyRound

log = logging.getLogger("moshpitd.allreduce.butterfly")

# Receive buffers, reused across rounds: a fresh 1 MiB bytearray per link per round is zeroed
# by the kernel page by page before the first frame lands in it.
STAGING = ArrayPool(32 << 20)


class Outbox(asyncio.Queue[int]):
    """Parts whose results still go back to one sender. Once its stream is gone nothing is kept
    for it: the round waits until every outbox is empty, and this one would never empty."""

    closed = False

    def put_nowait(self, item: int) -> None:
        if not self.closed:
            super().put_nowait(item)

    def close(self) -> None:
        self.closed = True
        while not self.empty():
            self.get_nowait()


class SenderSlot:
    """Reducer side: frames from one sender."""

    def __init__(self, rnd: ButterflyRound, sender: int, channel: Channel) -> None:
        self.rnd = rnd
        self.sender = sender
        self.channel = channel
        self.expected = {p.index for p in rnd.my_parts}
        self.staging = rnd.staging()
        self.outbox = Outbox()
        rnd.hooks.sender_accepted()

    def buffer_for(self, kind: int, part: int, length: int, aux: int) -> memoryview | None:
        if kind != PART:
            return None
        p = self.rnd.part(part)
        if p is None or part not in self.expected:
            raise DataPlaneError(f"member {self.sender} sent part {part}, not expected here")
        want = self.rnd.codec.encoded_size(p.numel, self.rnd.dtypes[p.run])
        if length != want:
            raise DataPlaneError(f"part {part}: {length} bytes, expected {want}")
        return self.staging  # it has room for the next header past the payload

    def on_frame(self, kind: int, part: int, payload: memoryview, aux: int) -> None:
        if kind == PART:
            self.expected.discard(part)
            p = self.rnd.parts[part]
            try:
                values = self.rnd.codec.decode(payload, p.numel, self.rnd.dtypes[p.run])
                self.rnd.contribute(p, self.sender, values)
            except (ReductionError, CodecError) as exc:
                self.channel.abort(exc, part, BAD_VALUES)  # first: exclude's abort says less
                self.rnd.exclude(self.sender, str(exc), "bad_data")
        elif kind == ABORT:
            self.rnd.exclude(self.sender, f"it aborted: {bytes(payload).decode(errors='replace')}",
                             "aborted")
        else:
            self.rnd.exclude(self.sender, f"unexpected frame kind {kind}", "protocol")
            self.channel.abort(f"unexpected frame kind {kind}")

    def on_close(self, exc: BaseException | None) -> None:
        self.outbox.close()
        if self.expected:
            self.rnd.exclude(self.sender, f"its stream closed ({exc or 'EOF'})", "disconnected")

    async def write_results(self) -> None:
        """Results go back in the order parts become final."""
        sent = 0
        while True:
            index = await self.outbox.get()
            mask = self.rnd.applied.get(index, 0)
            payload = self.rnd.result_payload(index) if mask else b""
            p = self.rnd.parts[index]
            payload = await self.rnd.hooks.before_result(sent, payload, self.rnd.codec, p.numel,
                                                         self.rnd.dtypes[p.run])
            sent += 1
            try:
                await self.channel.send(RESULT, index, payload, aux=mask)
            except DataPlaneError:
                self.outbox.close()
                return  # the sender is gone; its link will report that on its side


# A member streams its parts once every owner has the round (it answers our HELLO with READY),
# or START_WAIT after the round started. Members learn of their group up to ~20-30 ms apart on a
# busy machine: those that stream meanwhile take the CPU the late one needs to learn of it, and
# then it is left alone with its share of the work at the end of the round, one core idle.
START_WAIT = 0.25


class ReadyGate:
    """Every owner READY (or failed): one event per round, whatever the group's size."""

    def __init__(self, owners: int) -> None:
        self.left = owners
        self.until = time.monotonic() + START_WAIT
        self.event = asyncio.Event()
        if owners <= 0:
            self.event.set()

    def mark(self) -> None:
        self.left -= 1
        if self.left <= 0:
            self.event.set()

    async def wait(self, deadline: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(min(self.until, deadline) - time.monotonic(), 0)):
                await self.event.wait()


# Past the round's deadline, a peer must show new bytes this often to be waited for, and never
# beyond the round's hard deadline (node.py: one more budget, so at most twice the budget).
STALL_WINDOW = 1.0


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
        self.staging = rnd.staging()  # results land here to be checked
        self.ready = False  # READY came (or the owner failed): see START_WAIT

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
        return self.staging  # consumed by on_frame before the next frame

    def on_frame(self, kind: int, part: int, payload: memoryview, aux: int) -> None:
        if kind == READY:
            self._ready()
            return
        if kind == ABORT:
            if aux == BAD_VALUES:  # were our values to blame? then our trainer hears of it
                self.rnd.recheck(part)
            self.fail(bytes(payload).decode(errors="replace"))
            return
        if kind != RESULT:
            self.fail(f"unexpected frame kind {kind}")
            return
        p = self.rnd.parts[part]
        if aux and (aux >> len(self.rnd.group.members)):
            self.fail(f"result {part} names members that do not exist")
            return
        if aux:
            values = self.rnd.codec.decode(payload, p.numel, self.rnd.dtypes[p.run])
            if all_finite(values):
                self.rnd.view.write(p, values)
            else:
                log.warning("owner %d returned NaN or Inf for part %d: it keeps local values",
                            self.owner, part)
                aux = 0
        self.rnd.applied[part] = aux
        self.waiting.discard(part)
        if not self.waiting:
            self.done.set()
        self.progress.set()

    def in_flight(self, sent: int) -> int:
        return sent - (self.total - len(self.waiting))

    def on_close(self, exc: BaseException | None) -> None:
        """Closed without a word: its daemon is gone (or its round is over), so its parts will
        not come either; that holds even when all its results are in and it never connected
        to us as a sender, which would otherwise leave us waiting for the deadline."""
        if self.failure is not None:
            return
        if self.waiting:
            self.fail(f"stream closed ({exc or 'EOF'})")
        if self.rnd.reducer.lacking(self.owner):
            self.rnd.exclude(self.owner, "its connection dropped", "disconnected")

    def fail(self, why: str) -> None:
        if self.failure is None and self.waiting:
            self.failure = why
            log.info("owner %d failed: %s; its %d remaining parts keep local values",
                     self.owner, why, len(self.waiting))
        self.done.set()
        self.progress.set()
        self._ready()

    def _ready(self) -> None:
        if not self.ready:
            self.ready = True
            self.rnd.gate.mark()
