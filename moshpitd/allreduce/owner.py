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
from collections.abc import Callable

import numpy as np

from moshpitd import timebase
from moshpitd.allreduce.layout import LayoutError, Part
from moshpitd.allreduce.ownercheck import OwnerCheck
from moshpitd.allreduce.plan import Ledger, RoundPlan
from moshpitd.allreduce.reducer import PartReducer, ReductionError
from moshpitd.allreduce.senderslot import SenderSlot
from moshpitd.hooks import Hooks
from moshpitd.identity import PeerKey
from moshpitd.transport.dataplane import Channel, DataPlaneError

log = logging.getLogger("moshpitd.allreduce.butterfly")


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
            self.check.keep_own(self.ledger)
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
                async with asyncio.timeout(max(deadline - timebase.monotonic(), 0)):
                    await self._done.wait()
                return
            now = timebase.monotonic()
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
                async with asyncio.timeout(max(until - timebase.monotonic(), 0)):
                    await self._joined.wait()
            if timebase.monotonic() >= until:
                return

    async def run_check(self, until: float, patience: float) -> None:
        """A checked round's owner side, once our parts are final (allreduce/ownercheck.py)."""
        if self.check is None:
            return
        self.check.fix_commitments(self.reducer.excluded)

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
