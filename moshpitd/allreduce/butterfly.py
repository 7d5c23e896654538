"""One butterfly all-reduce round on the data plane (scatter-reduce + all-gather, pipelined).

Member j reduces span j. Every member streams its parts of span j to member j, which accumulates
them as they arrive and streams each averaged part back as soon as it is final
(docs/architecture.md, "The butterfly round"). A member of weight 0 (a *listener*: a trainer
that just joined, say) owns no span and sends no parts; it only takes the results. Nobody waits
for its parts, and an owner holds its results for it at most the start wait (as long as a
member may take to learn of its group). The round is two roles over one plan: the sender side
(sender.py) streams our parts to each owner and takes back the results; the reducer side
(owner.py) reduces our span for every sender. Each owns its state; they share only the plan and
the ledger (plan.py), and the reducer side hears from the sender side through Exclusions.

Faults follow the round's deadlines (moshpitd/clock.py): a sender whose connection breaks is
excluded at once, one that is silent at the deadline is excluded then (one whose bytes still
flow, on a slow link, is waited for a stall window at a time up to the hard stop); parts it
delivered stay in the mean. A reducer that fails, or returns NaN/Inf, leaves its part at our
local values. Every result carries the bitmask of the senders it averages, so the caller learns
exactly what each element is. An owner that refuses our part as NaN/Inf says so (ABORT with
BAD_VALUES and the part); we check that part ourselves, and if the fault is ours the trainer
gets the error (LayoutError naming the tensor) when the round ends. A member that leaves the
round (its trainer is gone, or its request was cancelled) says so on every stream (ABORT with
LEFT), and those ABORTs go out before the round returns: the others exclude it as `aborted` at
once, not as a dropped stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

import numpy as np

from moshpitd import timebase
from moshpitd.allreduce.codecs import Codec
from moshpitd.allreduce.deadlines import RoundDeadlines
from moshpitd.allreduce.group import Group
from moshpitd.allreduce.layout import DEFAULT_PART_BYTES, FlatView
from moshpitd.allreduce.owner import ReducerSide
from moshpitd.allreduce.plan import Ledger, RoundPlan
from moshpitd.allreduce.rates import BOTTLENECK, link_rates, stream_rate
from moshpitd.allreduce.sender import Connector, SenderSide, Sessions
from moshpitd.allreduce.senderslot import SenderSlot
from moshpitd.hooks import NO_HOOKS, Hooks
from moshpitd.transport.dataplane import LEFT, Channel, flush_aborts
from moshpitd.transport.handshake import Handshake
from moshpitd.transport.stats import Stats

# How often the round looks again whether every result went out to the transports: they may
# hold views of the trainer's buffer until then (a protocol constant: the poll's granularity).
DRAIN_POLL = 0.001

log = logging.getLogger("moshpitd.allreduce.butterfly")


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
    rates: tuple[float, float] = (0.0, 0.0)  # bytes/s we sent and received at (rates.py)
    lied: tuple[int, ...] = ()  # owners whose span failed its check (allreduce/verifier.py)
    unchecked: int = 0  # owners whose span's check could not finish (it kept local values)
    # bytes/s that members whose links held their streams to us back carried (the faster of
    # their results and their parts): what a leader caps declared rates by
    peer_rates: tuple[tuple[bytes, float], ...] = ()
    bytes_reduced: int = 0  # of bytes_received, what members sent us as an owner


class ButterflyRound:
    def __init__(self, group: Group, my_index: int, view: FlatView, codec: Codec,
                 connect: Connector, handshake: Handshake,
                 part_bytes: int = DEFAULT_PART_BYTES, hooks: Hooks = NO_HOOKS,
                 aggregation: str = "mean", max_in_flight: int = 64,
                 sessions: Sessions | None = None, checked: bool = False) -> None:
        self.plan = RoundPlan(group, my_index, view, codec, part_bytes, aggregation, checked)
        self.ledger = Ledger(self.plan)
        self.hooks = hooks
        self.reducer = ReducerSide(self.plan, self.ledger, hooks, aggregation, max_in_flight,
                                   handshake.key)
        self.lied: tuple[int, ...] = ()
        self.unchecked = 0
        self._connect = connect
        self._handshake = handshake
        self._max_in_flight = max_in_flight
        self._accepted: list[Channel] = []  # senders' streams, while they are ours
        self._released: list[Stats] = []  # those that ended cleanly, kept as sessions
        self._sessions = sessions
        if sessions is not None:
            self.reducer.release = self._release
        self.rates = (0.0, 0.0)
        self.reduced_in = 0
        self.peer_rates: dict[bytes, float] = {}
        # the round starts here: the data plane may hand it streams as soon as it is registered
        # (those that waited for the group), before `run`
        self.hooks.begin_round(self.plan.link_parts(), self.plan.senders(),
                               self.plan.listening)

    @property
    def group(self) -> Group:
        return self.plan.group

    @property
    def me(self) -> int:
        return self.plan.me

    def accept(self, sender: int, channel: Channel) -> SenderSlot:
        """A sender's stream arrived (after its HELLO): the data plane hands it to us."""
        slot = self.reducer.accept(sender, channel)
        self._accepted.append(channel)
        return slot

    def _release(self, channel: Channel) -> None:
        """A sender's stream ended cleanly: its connection is no longer this round's."""
        assert self._sessions is not None
        self._accepted.remove(channel)
        self._released.append(channel.stats())
        self._sessions.release(channel)

    async def run(self, deadlines: RoundDeadlines) -> RoundResult:
        """The whole round from our side; returns once every part is settled or the hard stop
        came. The trainer's buffer is ours until then, and untouched after."""
        start = timebase.monotonic()
        sender = SenderSide(self.plan, self.ledger, self._connect, self.hooks, self.reducer,
                            self._handshake, self._max_in_flight, deadlines.start_wait_until,
                            self._sessions)
        sender.start(deadlines.deadline)
        self.reducer.seed_own()
        leaving = False
        reduced = start
        checking: asyncio.Task[None] | None = None
        try:
            await self.reducer.wait_for_senders(deadlines.deadline, deadlines.hard,
                                                deadlines.stall_window)
            reduced = timebase.monotonic()
            checking = asyncio.create_task(self.reducer.run_check(
                deadlines.hard + deadlines.grace, deadlines.grace))
            await self.reducer.wait_for_listeners(min(deadlines.start_wait_until,
                                                      deadlines.deadline))
            await self._wait_for_owners(sender, deadlines, checking)
            sender.fail_unanswered("no result by the round's deadline")
        except BaseException:
            leaving = True
            for ch in [*sender.channels, *self._accepted]:
                ch.abort("the peer left the round", code=LEFT)
            raise
        finally:
            if checking is not None:
                checking.cancel()
            self.ledger.closed = True  # the trainer owns its buffer again: late events write
            self.reducer.stop()        # nothing
            self._judge(sender)
            try:
                await sender.stop()
                if leaving:  # every member hears why, not a dropped stream: see flush_aborts
                    await flush_aborts([*sender.channels, *self._accepted], deadlines.grace)
            finally:
                sent = received = 0
                streams = [*sender.channels, *self._accepted]
                self.reduced_in = sum(st.bytes_in for st in [  # as an owner: /metrics
                    *(ch.stats() for ch in self._accepted), *self._released])
                stats = [*(ch.stats() for ch in streams), *sender.finished, *self._released]
                self.rates = link_rates(stats)
                for st in stats:
                    sent, received = sent + st.bytes_out, received + st.bytes_in
                self._time_peers(sender)
                for ch in streams:
                    ch.close()  # nothing is received into staging buffers after this
                self.ledger.close()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("round phases (s after its start): owners ready %.3f, parts sent %.3f, "
                      "span's contributions in %.3f, end %.3f", sender.gate.opened - start,
                      max((ln.sent_at for ln in sender.links), default=start) - start,
                      reduced - start, timebase.monotonic() - start)
        if self.ledger.invalid is not None:
            raise self.ledger.invalid
        return self._result(timebase.monotonic() - start, sent, received)

    def _time_peers(self, sender: SenderSide) -> None:
        """What the members whose own links held their streams to us back carried this round
        (allreduce/rates.py PeerRates: a leader caps declared rates by it). A stream as fast
        as the others into us was held back by our link, and bounds nothing of its sender's."""
        members = self.plan.group.members
        timed = [(link.owner, link.stats()) for link in sender.links]
        timed += [(slot.sender, slot.stats()) for slot in self.reducer.slots.values()]
        rates: dict[bytes, float] = {}
        for index, stats in timed:
            rate = stream_rate(stats) if stats is not None else 0.0
            if rate > 0:
                peer = members[index].peer_id
                rates[peer] = max(rate, rates.get(peer, 0.0))
        fastest = max(rates.values(), default=0.0)
        self.peer_rates = {p: r for p, r in rates.items() if r < BOTTLENECK * fastest}

    def _judge(self, sender: SenderSide) -> None:
        """Which owners' spans failed their check, and how many could not be checked."""
        checks = [link for link in sender.links if link.check is not None]
        owners = [link.owner for link in checks if link.check and link.check.lied]
        claimants = sorted(self.reducer.check.disputed) if self.reducer.check else []
        self.lied = tuple(sorted({*owners, *claimants}))
        self.unchecked = sum(1 for link in checks if link.check is not None
                             and not link.waiting  # (else the owner failed, as ever)
                             and not (link.check.verdict and link.check.verdict.ok)
                             and not link.check.lied)

    async def _wait_for_owners(self, sender: SenderSide, d: RoundDeadlines,
                               checking: asyncio.Task[None] | None = None) -> None:
        """Until every owner answered all our parts (or failed) and our results went out.
        An owner may be waiting on a slow third member: while bytes still move anywhere in
        the round, keep waiting, a stall window at a time up to the hard stop plus grace."""
        moved = -1
        deadline, hard = d.deadline + d.grace, d.hard + d.grace
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(deadline - timebase.monotonic(), 0)):
                    await sender.all_answered()
                    if checking is not None:
                        await asyncio.shield(checking)
                    while not self.reducer.drained():
                        await asyncio.sleep(DRAIN_POLL)
                return
            now = timebase.monotonic()
            total = sender.progress() + self.reducer.progress()
            if total <= moved or now >= hard:
                return
            moved, deadline = total, min(now + d.stall_window, hard)

    def _result(self, seconds: float, sent: int, received: int) -> RoundResult:
        plan, ledger = self.plan, self.ledger
        starts = np.cumsum([0] + [r.numel for r in plan.view.runs]).tolist()
        spans: list[tuple[int, int, int]] = []
        for p in plan.parts:
            lo, hi, mask = starts[p.run] + p.start, starts[p.run] + p.stop, ledger.mask(p.index)
            if spans and spans[-1][1] == lo and spans[-1][2] == mask:
                spans[-1] = (spans[-1][0], hi, mask)
            else:
                spans.append((lo, hi, mask))
        spans.sort()
        averaged = sum(1 for p in plan.parts if ledger.mask(p.index))
        return RoundResult(plan.size, len(plan.parts), averaged, tuple(spans), sent, received,
                           seconds, self.reducer.excluded,
                           sum(p.numel for p in plan.my_parts),
                           dict(self.reducer.excluded_parts), self.rates,
                           self.lied, self.unchecked, tuple(self.peer_rates.items()),
                           self.reduced_in)
