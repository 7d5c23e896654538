"""The reducer side of a butterfly round: the parts of our span arrive from every sender, are
reduced as they come, and each averaged part goes back to every sender as soon as it is final.

Our own values are not read in a separate pass before the round (that pass cost every byte of
the request one more trip from memory, and on a busy machine delayed the round's start). Every
contribution is checked as it arrives; our own span is checked where it is hot, as each part's
result is computed: a part our values made NaN/Inf goes back to nobody (mask 0: every member
keeps its own values there), and the trainer gets the error when the round ends. With codec
fp16 our span is also checked for fp16's range first, so that a value it cannot carry is
refused wherever it lies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import numpy as np

from moshpitd.allreduce.checks import CheckError
from moshpitd.allreduce.codecs import CodecError
from moshpitd.allreduce.layout import LayoutError, Part
from moshpitd.allreduce.ownercheck import OwnerCheck
from moshpitd.allreduce.plan import Ledger, RoundPlan
from moshpitd.allreduce.reducer import PartReducer, ReductionError
from moshpitd.allreduce.verifier import CLAIM, COMMIT, COMMITS, END, REVEAL, SEEDS
from moshpitd.hooks import Hooks
from moshpitd.identity import PeerKey
from moshpitd.transport.dataplane import (
    ABORT,
    BAD_VALUES,
    CHECK,
    PART,
    RESULT,
    Channel,
    DataPlaneError,
    TamperedFrame,
)
from moshpitd.transport.stats import Stats

log = logging.getLogger("moshpitd.allreduce.butterfly")


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
    """Frames from one sender, and our results back to it."""

    def __init__(self, side: ReducerSide, sender: int, channel: Channel) -> None:
        self.side = side
        self.plan = side.plan
        self.sender = sender
        self.channel = channel
        listener = side.plan.group.listeners >> sender & 1
        self.expected = set() if listener else {p.index for p in side.plan.my_parts}
        self.staging = side.ledger.staging()
        self.outbox = Outbox()
        self.released: Stats | None = None  # the stream ended cleanly: its connection is
        # the registry's again (a kept session), and these were its bytes, which end at
        self.released_end = 0  # this offset of the connection (`Channel.written`)
        self.ended = False  # a checked round's END went out (or the stream is gone)

    def buffer_for(self, kind: int, part: int, length: int, aux: int) -> memoryview | None:
        if kind != PART:
            return None
        p = self.plan.part(part)
        if p is None or part not in self.expected:
            raise DataPlaneError(f"member {self.sender} sent part {part}, not expected here")
        want = self.plan.encoded_size(p)
        if length != want:
            raise DataPlaneError(f"part {part}: {length} bytes, expected {want}")
        return self.staging  # it has room for the next header past the payload

    def on_frame(self, kind: int, part: int, payload: memoryview, aux: int) -> None:
        if kind == PART:
            self.expected.discard(part)
            p = self.plan.parts[part]
            try:
                values = self.plan.codec.decode(payload, p.numel, self.plan.dtypes[p.run])
                self.side.contribute(p, self.sender, values)
            except (ReductionError, CodecError) as exc:
                self.channel.abort(exc, part, BAD_VALUES)  # first: exclude's abort says less
                self.side.exclude(self.sender, str(exc), "bad_data")
        elif kind == CHECK and self.side.check is not None:
            try:
                self._on_check(aux, payload)
            except CheckError as exc:
                self.side.exclude(self.sender, f"its check messages are wrong: {exc}",
                                  "protocol")
                self.channel.abort(f"check: {exc}")
        elif kind == ABORT:
            self.side.exclude(self.sender,
                              f"it aborted: {bytes(payload).decode(errors='replace')}",
                              "aborted")
        else:
            self.side.exclude(self.sender, f"unexpected frame kind {kind}", "protocol")
            self.channel.abort(f"unexpected frame kind {kind}")

    def _on_check(self, step: int, payload: memoryview) -> None:
        check = self.side.check
        assert check is not None
        if step == COMMIT:
            check.on_commit(self.sender, payload)
        elif step == REVEAL:
            check.on_reveal(self.sender, payload)
        elif step == CLAIM:
            check.on_claim(self.sender, payload)
        else:
            raise CheckError(f"check step {step} is not one a sender sends")

    def on_close(self, exc: BaseException | None) -> None:
        self.ended = True
        self.outbox.close()
        if isinstance(exc, TamperedFrame):  # its later parts would be no more trustworthy
            self.side.exclude(self.sender, f"its stream was tampered with: {exc}", "tampered")
        elif self.expected:
            self.side.exclude(self.sender, f"its stream closed ({exc or 'EOF'})",
                              "disconnected")

    def progress(self) -> int:
        return self.stats().progress()

    def stats(self) -> Stats:
        """This round's bytes on the sender's stream (its connection may carry the next)."""
        return self.released if self.released is not None else self.channel.stats()

    def drained(self) -> bool:
        if self.released is not None:  # the connection may carry another round's stream
            return self.channel.flushed(self.released_end) or not self.channel.is_open()
        transport = self.channel.transport
        if self.side.check is not None and not self.ended:
            return False
        return self.outbox.empty() and (transport is None or transport.is_closing()
                                        or transport.get_write_buffer_size() == 0)

    def results_out(self) -> bool:
        """Every result went to the transport and left it (so the sender has them, or will
        soon): from then on we wait for its word for a while only."""
        transport = self.channel.transport
        return self.outbox.empty() and (transport is None or transport.is_closing()
                                        or transport.get_write_buffer_size() == 0)

    async def write_results(self) -> None:
        """Results go back in the order parts become final (in a checked round after our
        list of commitments, and followed by the check's frames)."""
        check = self.side.check
        sent = 0
        while True:
            index = await self.outbox.get()
            mask = self.side.ledger.mask(index)
            payload = self.side.result_payload(index) if mask else b""
            p = self.plan.parts[index]
            payload = await self.side.hooks.before_result(sent, payload, self.plan.codec,
                                                          p.numel, self.plan.dtypes[p.run])
            sent += 1
            last = sent == len(self.plan.my_parts) and not self.expected
            try:
                if check is not None and sent == 1:
                    await self.channel.send(CHECK, index, check.fix_commitments(), aux=COMMITS)
                await self.channel.send(RESULT, index, payload, aux=mask,
                                        then=self._release if last and check is None else None)
                if last and check is not None:
                    await self._checked(check)
            except DataPlaneError:
                self.outbox.close()
                self.ended = True
                return  # the sender is gone; its link will report that on its side
            if last:
                return

    async def _checked(self, check: OwnerCheck) -> None:
        """After our last result: the seeds, then every other contributor's claim, then END
        (which hands a kept session on, as the last result does in an unchecked round)."""
        await check.seeds_out.wait()
        await self.channel.send(CHECK, 0, check.seeds_payload(), aux=SEEDS)
        await check.claims_out.wait()
        for claimant, claim in check.claims.items():
            if claimant != self.sender:
                await self.channel.send(CHECK, 0, claim, aux=CLAIM)
        await self.channel.send(CHECK, 0, b"", aux=END, then=self._release)
        self.ended = True

    def _release(self) -> None:
        """Every part came in and this is the last result: the connection may carry the
        sender's next stream. Handed on as the result is queued, before the sender can answer
        it (its next frame may be a new stream's ATTACH). The result may still wait in our
        send buffer, as views of the trainer's buffer: the round waits for it to drain as
        before (`drained`), and drops it if the round ends first (`abort_undrained`)."""
        side = self.side
        if side.release is None or side.ledger.closed or not self.channel.is_open() \
                or side.reducer.excluded >> self.sender & 1:
            return
        self.released = self.channel.stats()
        self.released_end = self.channel.written
        side.release(self.channel)

    def abort_undrained(self) -> None:
        """The round is over: a handed-on connection still holding this round's result (a
        view of the trainer's buffer) is closed, its bytes dropped, as the round's own are."""
        if self.released is not None and not self.drained():  # (once the sender has our
            self.channel.close()  # last result, anything unsent is another stream's)


class ReducerSide:
    """Our span: a slot per sender, the reducer, finalising parts, and waiting for senders."""

    def __init__(self, plan: RoundPlan, ledger: Ledger, hooks: Hooks, aggregation: str,
                 max_in_flight: int, key: PeerKey | None = None) -> None:
        self.plan = plan
        self.check = OwnerCheck(plan, key) if plan.checking and key is not None \
            and plan.my_parts else None
        self.ledger = ledger
        self.hooks = hooks
        self.max_in_flight = max_in_flight
        self.reducer = PartReducer(plan.my_parts, plan.dtypes, senders=plan.size,
                                   aggregation=aggregation, listeners=plan.group.listeners)
        self.slots: dict[int, SenderSlot] = {}
        self.excluded_parts: dict[str, int] = {}  # fault kind -> parts
        # where a sender's connection goes once its stream ended cleanly (a kept session)
        self.release: Callable[[Channel], None] | None = None
        self._payloads: dict[int, memoryview] = {}
        self._pending = {p.index for p in plan.my_parts}
        self._done = asyncio.Event()
        self._joined = asyncio.Event()  # set as each stream arrives
        self._writers: set[asyncio.Task[None]] = set()

    @property
    def excluded(self) -> int:
        """Bitmask of members whose contributions were cut short."""
        return self.reducer.excluded

    def seed_own(self) -> None:
        """Our own contribution, in place where it can be (see PartReducer.seed)."""
        plan = self.plan
        weight = plan.group.members[plan.me].weight
        if self.check is not None and not plan.listening:
            self.check.keep_own()
        for p in [] if plan.listening else plan.my_parts:
            if plan.fp16_range:  # fp16 refuses what it could not carry wherever it lies,
                try:             # though our own span's values never travel as fp16
                    plan.view.check_part(p, fp16=True)
                except LayoutError as exc:  # our span is averaged without us from here on
                    self.ledger.refuse(exc)
                    self.exclude(plan.me, "its own values are beyond fp16's range", "bad_data")
                    break
            pieces = plan.view.views(p)
            if self.reducer.seed(p.index, plan.me, weight,
                                 pieces[0] if len(pieces) == 1 else pieces):
                self._finalise(p.index)
        if not self._pending:
            self._done.set()

    def check_sender(self, sender: int) -> None:
        """May a stream as `sender` still come? (Before its handshake is checked.)"""
        if not 0 <= sender < self.plan.size or sender == self.plan.me:
            raise DataPlaneError(f"sender index {sender} is not valid in this group")
        if sender in self.slots or self.reducer.excluded >> sender & 1:
            raise DataPlaneError(f"sender {sender} already streamed or was excluded")

    def accept(self, sender: int, channel: Channel) -> SenderSlot:
        """A sender's stream arrived, its handshake proven (registry.py)."""
        self.check_sender(sender)
        slot = SenderSlot(self, sender, channel)
        self.slots[sender] = slot
        self._joined.set()
        self.hooks.sender_accepted()
        for p in self.plan.my_parts:  # final before it came: a listener is not waited for
            if p.index not in self._pending:
                slot.outbox.put_nowait(p.index)
        task = asyncio.create_task(slot.write_results())
        self._writers.add(task)
        task.add_done_callback(self._writers.discard)
        return slot

    def contribute(self, part: Part, sender: int, values: np.ndarray | list[np.ndarray],
                   weight: float | None = None) -> None:
        if self.ledger.closed:
            return  # the trainer's buffer is its own again
        if part.owner != self.plan.me:
            raise ReductionError(f"part {part.index} is not reduced by member {self.plan.me}")
        w = self.plan.group.members[sender].weight if weight is None else weight
        if sender != self.plan.me:
            self.hooks.contribution()
        if self.reducer.add(part.index, sender, w, values, trusted=sender == self.plan.me):
            self._finalise(part.index)

    def exclude(self, sender: int, why: str, fault: str = "other") -> None:
        if self.ledger.closed or self.reducer.excluded >> sender & 1:
            return
        lacking = self.reducer.lacking(sender)
        self.excluded_parts[fault] = self.excluded_parts.get(fault, 0) + lacking
        log.info("excluding member %d of group %s: %s", sender,
                 self.plan.group.group_id.hex()[:8], why)
        for index in self.reducer.exclude(sender):
            self._finalise(index)
        slot = self.slots.get(sender)
        if slot is not None and slot.released is None:
            slot.channel.abort(f"excluded: {why}")

    def lost(self, sender: int, why: str, fault: str) -> None:
        if self.reducer.lacking(sender):
            self.exclude(sender, why, fault)

    def _finalise(self, index: int) -> None:
        if self.ledger.closed:
            return
        plan = self.plan
        part = plan.parts[index]
        mask = self.reducer.mask(index)
        if mask:
            pieces = plan.view.views(part)
            if len(pieces) == 1 or plan.codec.name != "none":
                # the result lands in the trainer's buffer and is sent back from there
                self.reducer.result_into(index, pieces)
            else:  # kept whole: it is the one payload that goes back to each sender
                plan.view.write(part, self.reducer.result(index))
            # contributions were checked as they arrived and weigh at most 1 (unit_weights),
            # so a result that is not finite (or that fp16 cannot carry) comes from our own
            # values (or a sum of values near the dtype's limit): refuse it
            if not self.ledger.check(part):
                mask = 0  # every member keeps its own values here
        self.ledger.apply(index, mask)
        self._pending.discard(index)
        for sender, slot in self.slots.items():
            if not self.reducer.excluded >> sender & 1:
                slot.outbox.put_nowait(index)
        if not self._pending:
            self._done.set()

    def result_payload(self, index: int) -> memoryview:
        """An averaged part's wire bytes, from where `_finalise` left it."""
        payload = self._payloads.get(index)
        if payload is None:
            pieces = self.plan.view.views(self.plan.parts[index])
            if self.plan.codec.name != "none":
                (payload,) = self.plan.codec.encode_pieces(pieces)
            elif len(pieces) == 1:
                payload = pieces[0].data.cast("B")
            else:
                payload = self.plan.codec.encode(self.reducer.result(index))
            self._payloads[index] = payload
        return payload

    async def wait_for_senders(self, deadline: float, hard: float, stall_window: float) -> None:
        """Until our parts are final; exclude senders that stopped sending. One whose bytes
        still flow at the deadline (a slow link, not a dead peer) gets `stall_window` more at
        a time, up to `hard`."""
        seen: dict[int, int] = {}
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(deadline - time.monotonic(), 0)):
                    await self._done.wait()
                return
            now = time.monotonic()
            moving = False
            final = len(self.plan.my_parts) - len(self._pending)
            for sender in self._incomplete_senders():
                slot = self.slots.get(sender)
                got = slot.progress() if slot is not None else 0
                # a sender a full window ahead of our answers waits for us (for a slower
                # member), not the other way round: it is not silent
                delivered = len(self.plan.my_parts) - self.reducer.lacking(sender)
                blocked = delivered - final >= self.max_in_flight
                if now < hard and (got > seen.get(sender, 0) or blocked):
                    seen[sender], moving = got, True
                else:
                    self.exclude(sender, "silent past the round's deadline", "timeout")
            if not moving:
                return
            deadline = min(now + stall_window, hard)

    async def wait_for_listeners(self, until: float) -> None:
        """Until every listener's stream arrived (it takes the results we hold), or `until`:
        the start wait, as long as a member may take to learn of its group."""
        if not self.plan.my_parts:
            return  # nobody takes anything from us
        listeners = self.plan.group.listeners & ~(1 << self.plan.me)
        while any(listeners >> i & 1 and i not in self.slots for i in range(self.plan.size)):
            self._joined.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(until - time.monotonic(), 0)):
                    await self._joined.wait()
            if time.monotonic() >= until:
                return

    async def run_check(self, until: float, patience: float) -> None:
        """A checked round's owner side, once our parts are final (allreduce/ownercheck.py)."""
        if self.check is None:
            return
        self.check.fix_commitments()

        def draining(i: int) -> bool:
            slot = self.slots.get(i)
            return slot is not None and not slot.ended and not slot.results_out()

        await self.check.run(lambda: [self.ledger.mask(p.index) for p in self.plan.my_parts],
                             draining, until, patience)

    def drained(self) -> bool:
        """Every result went out (the transports may still hold views of them otherwise)."""
        return all(slot.drained() for slot in self.slots.values())

    def progress(self) -> int:
        return sum(slot.progress() for slot in self.slots.values())

    def _incomplete_senders(self) -> list[int]:
        """Senders some of our parts still wait for."""
        waiting = 0
        for p in self.plan.my_parts:
            if not self.reducer.is_final(p.index):
                waiting |= self.reducer.missing(p.index)
        return [s for s in range(self.plan.size) if waiting >> s & 1]

    def stop(self) -> None:
        """The round is over: open parts keep a mean, never a bare sum; no more results."""
        self.reducer.settle()
        for w in self._writers:
            w.cancel()
        for slot in self.slots.values():
            slot.abort_undrained()
