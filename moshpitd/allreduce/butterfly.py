"""One butterfly all-reduce round on the data plane (scatter-reduce + all-gather, pipelined).

Member j reduces span j. Every member streams its parts of span j to member j, which accumulates
them as they arrive and streams each averaged part back as soon as it is final (DESIGN §5).

Faults follow one deadline per round: a sender whose connection breaks is excluded at once, one
that is silent at the deadline is excluded then (one whose bytes still flow, on a slow link, is
waited for in STALL_WINDOW steps up to the round's hard deadline, one more budget: node.py);
parts it delivered stay in the mean. A reducer that fails, or returns NaN/Inf, leaves its part
at our local values. Every result carries the bitmask of the senders it averages, so the caller
learns exactly what each element is.

Our own values are not read in a separate pass before the round (that pass cost every byte of
the request one more trip from memory, and on a busy machine delayed the round's start). Every
owner checks each contribution anyway: one that refuses our part as NaN/Inf says so (ABORT with
BAD_VALUES and the part), we check that part ourselves, and if the fault is ours the trainer gets
the error (LayoutError naming the tensor) when the round ends; the owner averages without us.
Our own span is checked where it is hot, as each part's result is computed: a part our values
made NaN/Inf goes back to nobody (mask 0: every member keeps its own values there), and the
trainer gets the same error. (With codec fp16 our span is also checked for fp16's range first,
so that a value it cannot carry is refused wherever it lies.) The rest of the round runs.
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

from moshpitd.allreduce.codecs import Codec
from moshpitd.allreduce.group import Group
from moshpitd.allreduce.layout import (
    DEFAULT_PART_BYTES,
    FlatView,
    LayoutError,
    Part,
    plan_parts,
)
from moshpitd.allreduce.links import STAGING, STALL_WINDOW, OwnerLink, ReadyGate, SenderSlot
from moshpitd.allreduce.reducer import PartReducer, ReductionError
from moshpitd.hooks import NO_HOOKS, Hooks
from moshpitd.transport.dataplane import (
    HEADER,
    HELLO,
    PART,
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


class ButterflyRound:
    seal_hello: Callable[[bytes, int, int], bytes] | None = None
    closed = False  # run() returned: the trainer's buffer is no longer ours
    invalid: LayoutError | None = None  # our own values were refused (NaN/Inf)

    def __init__(self, group: Group, my_index: int, view: FlatView, codec: Codec,
                 connect: Connector, part_bytes: int = DEFAULT_PART_BYTES,
                 hooks: Hooks = NO_HOOKS, aggregation: str = "mean",
                 max_in_flight: int = 64) -> None:
        self.group = group
        self.max_in_flight = max_in_flight
        self.me = my_index
        self.view = view
        self.codec = codec
        self.fp16_range = codec.name == "fp16"  # values beyond it would be sent as Inf
        self.connect = connect
        self.hooks = hooks
        self.parts = plan_parts(view.runs, group.shares, part_bytes, codec)
        self.by_owner: dict[int, list[Part]] = defaultdict(list)
        for p in self.parts:
            self.by_owner[p.owner].append(p)
        self.my_parts = self.by_owner.get(my_index, [])
        self.gate = ReadyGate(sum(1 for owner in self.by_owner if owner != my_index))
        self.dtypes = {i: np.dtype(r.dtype) for i, r in enumerate(view.runs)}
        self.max_part_bytes = max([codec.encoded_size(p.numel, self.dtypes[p.run])
                                   for p in self.parts] or [0])
        self.reducer = PartReducer(self.my_parts, self.dtypes, senders=len(group.members),
                                   aggregation=aggregation)
        self.applied: dict[int, int] = {}  # part -> bitmask averaged into our buffer (0: local)
        self.slots: dict[int, SenderSlot] = {}
        self.excluded_parts: dict[str, int] = {}
        self._payloads: dict[int, memoryview] = {}
        self._own_done = asyncio.Event()
        self._pending_own = {p.index for p in self.my_parts}
        self._writers: set[asyncio.Task[None]] = set()
        self._channels: list[Channel] = []
        self._staging: list[np.ndarray] = []
        self.bytes_sent = 0
        self.bytes_received = 0

    def staging(self) -> memoryview:
        """A receive buffer for one part and the next frame's header, from STAGING; back
        there when the round ends."""
        buf = STAGING.take(self.max_part_bytes + HEADER.size, np.dtype(np.uint8))
        self._staging.append(buf)
        return buf.data

    def part(self, index: int) -> Part | None:
        return self.parts[index] if 0 <= index < len(self.parts) else None

    # --- the round, from our side -----------------------------------------------------
    async def run(self, deadline: float, grace: float, hard: float | None = None
                  ) -> RoundResult:
        """`deadline` is when a healthy round should be over; a peer whose bytes still flow
        then (a slow link, not a dead peer) gets STALL_WINDOW more at a time, up to `hard`."""
        start = time.monotonic()
        hard = deadline if hard is None else max(hard, deadline)
        links = [OwnerLink(self, owner, parts) for owner, parts in self.by_owner.items()
                 if owner != self.me]
        tasks = [asyncio.create_task(self._exchange(link, deadline)) for link in links]
        weight = self.group.members[self.me].weight
        for p in self.my_parts:  # in place where it can: see PartReducer.seed
            if self.fp16_range:  # fp16 refuses what it could not carry wherever it lies,
                try:             # though our own span's values never travel as fp16
                    self.view.check_part(p, fp16=True)
                except LayoutError as exc:  # our span is averaged without us from here on
                    self._refuse(exc)
                    self.exclude(self.me, "its own values are beyond fp16's range", "bad_data")
                    break
            pieces = self.view.views(p)
            if self.reducer.seed(p.index, self.me, weight,
                                 pieces[0] if len(pieces) == 1 else pieces):
                self._finalise(p.index)
        if not self._pending_own:
            self._own_done.set()
        try:
            await self._wait_for_senders(deadline, hard)
            await self._wait_for_owners(links, deadline + grace, hard + grace)
            for link in links:
                link.fail("no result by the round's deadline")
        except BaseException:
            for ch in self._channels:
                ch.abort("the peer left the round")
            raise
        finally:
            self.closed = True  # the trainer owns its buffer again: late events write nothing
            self.reducer.settle()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for w in self._writers:
                w.cancel()
            for ch in self._channels:
                self.bytes_sent += ch.bytes_out
                self.bytes_received += ch.bytes_in
                ch.close()  # nothing is received into staging buffers after this
            for buf in self._staging:
                STAGING.give(buf)
        if self.invalid is not None:
            raise self.invalid
        return self._result(time.monotonic() - start)

    def recheck(self, index: int) -> None:
        """An owner refused our part as data: if our values are to blame, remember it."""
        p = self.part(index)
        if p is not None and p.owner != self.me and not self.closed:
            try:
                self.view.check_part(p, self.fp16_range)
            except LayoutError as exc:
                self._refuse(exc)

    def _refuse(self, exc: LayoutError) -> None:
        if self.invalid is None:
            self.invalid = LayoutError(f"{exc} (found during the round: parts of the request "
                                       "that were averaged before or beside it hold the "
                                       "group's mean)")
            log.warning("group %s: our trainer's values were refused: %s",
                        self.group.group_id.hex()[:8], exc)

    async def _exchange(self, link: OwnerLink, deadline: float) -> None:
        member = self.group.members[link.owner]
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0)):
                channel = await self.connect(member.data_endpoint, link)
            self._channels.append(channel)
            hello = self.group.group_id
            if self.seal_hello is not None:  # swarm key: reducers only take sealed streams
                hello = self.seal_hello(hello, self.me, link.owner)
            await channel.send(HELLO, link.owner, hello, aux=self.me)
            await self.gate.wait(deadline)  # every owner has the round: see START_WAIT
            for i, p in enumerate(self.by_owner[link.owner]):
                while link.in_flight(i) >= self.max_in_flight and not link.done.is_set():
                    link.progress.clear()  # the owner is behind: wait for its next answer
                    await link.progress.wait()
                if link.done.is_set():
                    break  # it failed or excluded us: nothing more to send
                await self.hooks.before_part(i)
                # straight from the trainer's buffer (codec none), piece by piece
                await channel.send(PART, p.index, *self.codec.encode_pieces(self.view.views(p)))
            await link.done.wait()
        except ConnectionRefusedError as exc:
            # nobody listens there: it died, so do not wait for its parts either
            link.fail(f"cannot connect: {exc!r}")
            self.exclude(link.owner, "its data plane refuses connections", "disconnected")
        except (OSError, ValueError, DataPlaneError) as exc:  # ValueError: a bad endpoint
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
        slot = SenderSlot(self, sender, channel)
        self.slots[sender] = slot
        self._channels.append(channel)
        task = asyncio.create_task(slot.write_results())
        self._writers.add(task)
        task.add_done_callback(self._writers.discard)
        return slot

    def contribute(self, part: Part, sender: int, values: np.ndarray | list[np.ndarray],
                   weight: float | None = None) -> None:
        if self.closed:
            return  # the trainer's buffer is its own again
        if part.owner != self.me:
            raise ReductionError(f"part {part.index} is not reduced by member {self.me}")
        w = self.group.members[sender].weight if weight is None else weight
        if sender != self.me:
            self.hooks.contribution()
        if self.reducer.add(part.index, sender, w, values, trusted=sender == self.me):
            self._finalise(part.index)

    def exclude(self, sender: int, why: str, fault: str = "other") -> None:
        if self.closed or self.reducer.excluded >> sender & 1:
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
        if self.closed:
            return
        part = self.parts[index]
        mask = self.reducer.mask(index)
        if mask:
            pieces = self.view.views(part)
            if len(pieces) == 1 or self.codec.name != "none":
                # the result lands in the trainer's buffer and is sent back from there
                self.reducer.result_into(index, pieces)
            else:  # kept whole: it is the one payload that goes back to each sender
                self.view.write(part, self.reducer.result(index))
            if not self._result_ok(part):
                mask = 0  # every member keeps its own values here
        self.applied[index] = mask
        self._pending_own.discard(index)
        for sender, slot in self.slots.items():
            if not self.reducer.excluded >> sender & 1:
                slot.outbox.put_nowait(index)
        if not self._pending_own:
            self._own_done.set()

    def _result_ok(self, part: Part) -> bool:
        """Contributions were checked as they arrived, so a result that is not finite (or
        that fp16 cannot carry) comes from our own values (or overflowed): refuse it."""
        try:
            self.view.check_part(part, self.fp16_range)
        except LayoutError as exc:
            self._refuse(exc)
            return False
        return True

    async def _wait_for_senders(self, deadline: float, hard: float) -> None:
        """Until our parts are final; exclude senders that stopped sending."""
        seen: dict[int, int] = {}
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(deadline - time.monotonic(), 0)):
                    await self._own_done.wait()
                return
            now = time.monotonic()
            moving = False
            final = len(self.my_parts) - len(self._pending_own)
            for sender in self._incomplete_senders():
                slot = self.slots.get(sender)
                got = slot.channel.progress() if slot is not None else 0
                # a sender a full window ahead of our answers waits for us (for a slower
                # member), not the other way round: it is not silent
                delivered = len(self.my_parts) - self.reducer.lacking(sender)
                blocked = delivered - final >= self.max_in_flight
                if now < hard and (got > seen.get(sender, 0) or blocked):
                    seen[sender], moving = got, True
                else:
                    self.exclude(sender, "silent past the round's deadline", "timeout")
            if not moving:
                return
            deadline = min(now + STALL_WINDOW, hard)

    async def _wait_for_owners(self, links: list[OwnerLink], deadline: float,
                               hard: float) -> None:
        """Until every owner answered all our parts (or failed) and our results went out.
        An owner may be waiting on a slow third member: while bytes still move anywhere in
        the round, keep waiting."""
        moved = -1
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(deadline - time.monotonic(), 0)):
                    await asyncio.gather(*(link.done.wait() for link in links))
                    await self._drain_writers()
                return
            now = time.monotonic()
            channels = [*self._channels, *(slot.channel for slot in self.slots.values())]
            total = sum(ch.progress() for ch in channels)
            if total <= moved or now >= hard:
                return
            moved, deadline = total, min(now + STALL_WINDOW, hard)

    def _incomplete_senders(self) -> list[int]:
        """Senders some of our parts still wait for."""
        waiting = 0
        for p in self.my_parts:
            if not self.reducer.is_final(p.index):
                waiting |= self.reducer.missing(p.index)
        return [s for s in range(len(self.group.members)) if waiting >> s & 1]

    def result_payload(self, index: int) -> memoryview:
        """An averaged part's wire bytes, from where `_finalise` left it."""
        payload = self._payloads.get(index)
        if payload is None:
            pieces = self.view.views(self.parts[index])
            if self.codec.name != "none":
                (payload,) = self.codec.encode_pieces(pieces)
            elif len(pieces) == 1:
                payload = pieces[0].data.cast("B")
            else:
                payload = self.codec.encode(self.reducer.result(index))
            self._payloads[index] = payload
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
