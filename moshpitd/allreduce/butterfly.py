"""One butterfly all-reduce round on the data plane (scatter-reduce + all-gather, pipelined).

Member j reduces span j. Every member streams its parts of span j to member j, which accumulates
them as they arrive and streams each averaged part back as soon as it is final (DESIGN §5).

Faults follow one deadline per round: a sender whose connection breaks is excluded at once, one
that is merely silent is excluded at the deadline; parts it delivered stay in the mean. A reducer
that fails leaves its span at our local values. Every result carries the bitmask of the senders
it averages, so the caller learns exactly what each element is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from moshpitd.allreduce.codecs import Codec, CodecError
from moshpitd.allreduce.faults import STALL_SECONDS, FaultPlan
from moshpitd.allreduce.group import Group
from moshpitd.allreduce.layout import DEFAULT_PART_BYTES, FlatView, Part, plan_parts
from moshpitd.allreduce.reducer import PartReducer, ReductionError
from moshpitd.transport.dataplane import (
    ABORT,
    HELLO,
    PART,
    RESULT,
    Channel,
    DataPlaneError,
    FrameSink,
)

log = logging.getLogger(__name__)

Connector = Callable[[str, FrameSink], Awaitable[Channel]]


class AllreduceError(Exception):
    """The round could not run at all for this peer."""


@dataclass(frozen=True)
class RoundResult:
    group_size: int
    parts: int
    parts_averaged: int
    spans: tuple[tuple[int, int, int], ...]  # (flat start, flat stop, contributors bitmask)
    bytes_sent: int
    bytes_received: int
    seconds: float
    excluded: int  # bitmask of members whose contributions were cut short
    owned: int = 0  # elements this peer reduced for the group
    excluded_parts: dict[str, int] = field(default_factory=dict)  # fault kind -> parts


class _SenderSlot:
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


class _OwnerLink:
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


class ButterflyRound:
    seal_hello: Callable[[bytes, int], bytes] | None = None

    def __init__(self, group: Group, my_index: int, view: FlatView, codec: Codec,
                 connect: Connector, part_bytes: int = DEFAULT_PART_BYTES,
                 fault: FaultPlan | None = None, aggregation: str = "mean",
                 max_in_flight: int = 64) -> None:
        self.group = group
        self.max_in_flight = max_in_flight
        self.me = my_index
        self.view = view
        self.codec = codec
        self.connect = connect
        self.fault = fault or FaultPlan()
        self.parts = plan_parts(view.runs, group.shares, part_bytes)
        self.by_owner: dict[int, list[Part]] = defaultdict(list)
        for p in self.parts:
            self.by_owner[p.owner].append(p)
        self.my_parts = self.by_owner.get(my_index, [])
        self.dtypes = {i: np.dtype(r.dtype) for i, r in enumerate(view.runs)}
        self.max_part_bytes = max([codec.encoded_size(p.numel, self.dtypes[p.run])
                                   for p in self.parts] or [0])
        self.reducer = PartReducer(self.my_parts, self.dtypes, senders=len(group.members),
                                   aggregation=aggregation)
        self.applied: dict[int, int] = {}  # part -> bitmask averaged into our buffer (0: local)
        self.slots: dict[int, _SenderSlot] = {}
        self.excluded_parts: dict[str, int] = {}
        self._payloads: dict[int, memoryview] = {}
        self._own_done = asyncio.Event()
        self._pending_own = {p.index for p in self.my_parts}
        self._writers: set[asyncio.Task[None]] = set()
        self._channels: list[Channel] = []
        self.bytes_sent = 0
        self.bytes_received = 0

    def part(self, index: int) -> Part | None:
        return self.parts[index] if 0 <= index < len(self.parts) else None

    # --- the round, from our side -----------------------------------------------------
    async def run(self, deadline: float, grace: float) -> RoundResult:
        start = time.monotonic()
        self.fault.before_send()
        weight = self.group.members[self.me].weight
        for p in self.my_parts:
            self.contribute(p, self.me, self.view.read(p), weight)
        if not self._pending_own:
            self._own_done.set()
        links = [_OwnerLink(self, owner, parts) for owner, parts in self.by_owner.items()
                 if owner != self.me]
        tasks = [asyncio.create_task(self._exchange(link, deadline)) for link in links]
        try:
            try:
                async with asyncio.timeout(max(deadline - time.monotonic(), 0)):
                    await self._own_done.wait()
            except TimeoutError:
                for sender in self._incomplete_senders():
                    self.exclude(sender, "silent past the round's deadline", "timeout")
            waits = [link.done.wait() for link in links]
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(deadline + grace - time.monotonic(), 0)):
                    await asyncio.gather(*waits)
                    await self._drain_writers()
            for link in links:
                link.fail("no result by the round's deadline")
        except BaseException:
            for ch in self._channels:
                ch.abort("the peer left the round")
            raise
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for w in self._writers:
                w.cancel()
            for ch in self._channels:
                self.bytes_sent += ch.bytes_out
                self.bytes_received += ch.bytes_in
                ch.close()
        return self._result(time.monotonic() - start)

    async def _exchange(self, link: _OwnerLink, deadline: float) -> None:
        member = self.group.members[link.owner]
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0)):
                channel = await self.connect(member.data_endpoint, link)
            self._channels.append(channel)
            hello = self.group.group_id
            if self.seal_hello is not None:  # swarm key: reducers only take sealed streams
                hello = self.seal_hello(hello, self.me)
            await channel.send(HELLO, 0, hello, aux=self.me)
            for i, p in enumerate(self.by_owner[link.owner]):
                while link.in_flight(i) >= self.max_in_flight and not link.done.is_set():
                    link.progress.clear()  # the owner is behind: wait for its next answer
                    await link.progress.wait()
                if link.done.is_set():
                    break  # it failed or excluded us: nothing more to send
                await self.fault.during_send(i)
                await channel.send(PART, p.index, self.codec.encode(self.view.read(p)))
            await link.done.wait()
        except ConnectionRefusedError as exc:
            # nobody listens there: it died, so do not wait for its parts either
            link.fail(f"cannot connect: {exc!r}")
            self.exclude(link.owner, "its data plane refuses connections", "disconnected")
        except (OSError, DataPlaneError) as exc:
            silent = link.failure is None  # no ABORT came: it died or broke the protocol
            link.fail(f"cannot stream to it: {exc!r}")
            if silent:
                self.exclude(link.owner, f"its stream failed: {exc!r}", "disconnected")
        except TimeoutError as exc:
            link.fail(f"cannot stream to it: {exc!r}")

    async def _drain_writers(self) -> None:
        """Until every result went out: the transports may still hold views of them."""
        for slot in self.slots.values():
            transport = slot.channel.transport
            while not slot.outbox.empty() or (
                transport is not None and not transport.is_closing()
                and transport.get_write_buffer_size() > 0
            ):
                await asyncio.sleep(0.001)

    # --- the reducer side ---------------------------------------------------------------
    def accept(self, sender: int, channel: Channel) -> FrameSink:
        """A sender's stream arrived (after its HELLO)."""
        if not 0 <= sender < len(self.group.members) or sender == self.me:
            raise DataPlaneError(f"sender index {sender} is not valid in this group")
        if sender in self.slots or self.reducer.excluded >> sender & 1:
            raise DataPlaneError(f"sender {sender} already streamed or was excluded")
        slot = _SenderSlot(self, sender, channel)
        self.slots[sender] = slot
        self._channels.append(channel)
        task = asyncio.create_task(slot.write_results())
        self._writers.add(task)
        task.add_done_callback(self._writers.discard)
        return slot

    def contribute(self, part: Part, sender: int, values: np.ndarray,
                   weight: float | None = None) -> None:
        if part.owner != self.me:
            raise ReductionError(f"part {part.index} is not reduced by member {self.me}")
        w = self.group.members[sender].weight if weight is None else weight
        if sender != self.me:
            self.fault.while_reducing()
        if self.reducer.add(part.index, sender, w, values, trusted=sender == self.me):
            self._finalise(part.index)

    def exclude(self, sender: int, why: str, fault: str = "other") -> None:
        if self.reducer.excluded >> sender & 1:
            return
        lacking = self.reducer.lacking(sender)
        self.excluded_parts[fault] = self.excluded_parts.get(fault, 0) + lacking
        log.info("excluding member %d of group %s: %s", sender, self.group.group_id.hex()[:8],
                 why)
        for index in self.reducer.exclude(sender):
            self._finalise(index)
        slot = self.slots.get(sender)
        if slot is not None:
            slot.channel.abort(f"excluded: {why}")

    def _finalise(self, index: int) -> None:
        part = self.parts[index]
        mask = self.reducer.mask(index)
        if mask:
            self.view.write(part, self.reducer.result(index))
        self.applied[index] = mask
        self._pending_own.discard(index)
        for sender, slot in self.slots.items():
            if not self.reducer.excluded >> sender & 1:
                slot.outbox.put_nowait(index)
        if not self._pending_own:
            self._own_done.set()

    def _incomplete_senders(self) -> list[int]:
        """Senders some of our parts still wait for."""
        waiting = 0
        for p in self.my_parts:
            if not self.reducer.is_final(p.index):
                waiting |= self.reducer.missing(p.index)
        return [s for s in range(len(self.group.members)) if waiting >> s & 1]

    def result_payload(self, index: int) -> memoryview:
        payload = self._payloads.get(index)
        if payload is None:
            payload = self._payloads[index] = self.codec.encode(self.reducer.result(index))
        return payload

    def _result(self, seconds: float) -> RoundResult:
        starts = np.cumsum([0] + [r.numel for r in self.view.runs]).tolist()
        spans: list[tuple[int, int, int]] = []
        for p in self.parts:
            lo, hi, mask = starts[p.run] + p.start, starts[p.run] + p.stop, self.applied.get(
                p.index, 0)
            if spans and spans[-1][1] == lo and spans[-1][2] == mask:
                spans[-1] = (spans[-1][0], hi, mask)
            else:
                spans.append((lo, hi, mask))
        spans.sort()
        averaged = sum(1 for p in self.parts if self.applied.get(p.index, 0))
        return RoundResult(len(self.group.members), len(self.parts), averaged, tuple(spans),
                           self.bytes_sent, self.bytes_received, seconds, self.reducer.excluded,
                           sum(p.numel for p in self.my_parts), dict(self.excluded_parts))
