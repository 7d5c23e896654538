"""Running one averaging request: its rounds, each matchmaking then a butterfly round.

The node (node.py) wires the parts together and owns the daemon's lifecycle; the runner gets
what it needs through its constructor and returns what a round did as a RoundOutcome, never as
data hung on an exception.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from moshpitd import timebase
from moshpitd.allreduce.butterfly import AllreduceError, ButterflyRound, RoundResult
from moshpitd.allreduce.codecs import get_codec
from moshpitd.allreduce.deadlines import DeadlinePolicy
from moshpitd.allreduce.group import Group
from moshpitd.allreduce.layout import FlatView, schema_hash
from moshpitd.allreduce.rates import PeerRates
from moshpitd.allreduce.registry import RoundRegistry
from moshpitd.clock import RoundClock
from moshpitd.dht.network import DHTNode
from moshpitd.hooks import Hooks
from moshpitd.matchmaking.errors import GroupNotFound, NoPartners
from moshpitd.matchmaking.grid import carried_weight
from moshpitd.matchmaking.liveness import Liveness
from moshpitd.matchmaking.matchmaker import LineWatcher, Matchmaker, MatchRequest, Self
from moshpitd.matchmaking.request import SettlePolicy
from moshpitd.matchmaking.runs import GridMismatch, RunDirectory
from moshpitd.matchmaking.shunned import LIAR_SECONDS, Shunned
from moshpitd.matchmaking.signing import PeerAuth
from moshpitd.metrics import Metrics
from moshpitd.node_config import NodeConfig, ShuttingDown
from moshpitd.rounds import AverageRequest, AverageResult, RoundLog, RoundRecord
from moshpitd.transport.control import ControlClient
from moshpitd.transport.handshake import ENCRYPTED

log = logging.getLogger("moshpitd.node")

Probe = Callable[[str, bytes], Awaitable[bool]]  # (endpoint, peer id): did that peer answer
PARTNER_KEYS = 64  # keys whose last partners we remember


@dataclass(frozen=True)
class RoundOutcome:
    """What one round did: its record, and for a round that averaged, the group, the spans
    (start, stop, contributors' mask), the members in mask bit order and what we reduced."""

    record: RoundRecord
    group: Group | None = None  # None: nobody came, we kept our values
    spans: tuple[tuple[int, int, int], ...] = ()
    members: tuple[str, ...] = ()
    owned: int = 0


@dataclass(frozen=True)
class Endpoints:
    """Who we are to our peers: our id, where we listen, and the key that proves the id."""

    peer_id: bytes
    grpc: str
    data: str
    auth: PeerAuth | None = None


class RoundRunner:
    def __init__(self, config: NodeConfig, me: Endpoints, dht: DHTNode, pool: ControlClient,
                 registry: RoundRegistry, hooks: Hooks, metrics: Metrics, rounds: RoundLog,
                 liveness: Liveness, draining: Callable[[], bool]) -> None:
        self.config = config
        self.me = me
        self.unreachable = False  # behind NAT with no relay yet: take part as a client
        self.on_group: Callable[[Group], None] = lambda group: None  # a round of ours starts
        self.dht = dht
        self.pool = pool
        self.registry = registry
        self.hooks = hooks
        self.metrics = metrics
        self.rounds = rounds
        self.liveness = liveness  # who answered our probes, over all keys
        self.probe: Probe = liveness.ask
        self.draining = draining
        self.deadlines = DeadlinePolicy()  # the rate it learns outlives a request
        self.settle = SettlePolicy()
        # key -> the other members of our last complete round under it (MatchRequest.partners)
        self.partners: OrderedDict[str, dict[bytes, str]] = OrderedDict()
        self.matchmakers: dict[str, Matchmaker] = {}  # key -> matchmaking in progress
        self.shunned = Shunned()  # leaders that stalled us, over all keys
        # owners whose span failed our check: never grouped with again while we run
        self.liars = Shunned(LIAR_SECONDS)
        metrics.watch_liars(lambda: len(self.liars))
        self.warned_unchecked = False
        self.checked = config.check_results == "on" or (
            config.check_results == "auto"
            and (config.swarm_key is not None or config.tls is not None))
        self.peer_rates = PeerRates()  # what each peer's streams carried to us, over all keys
        metrics.watch_rates(lambda: self.peer_rates.capped)
        self.finding: dict[str, asyncio.Future[Group]] = {}
        self.runs: dict[str, RunDirectory] = {}  # grid runs this daemon takes part in

    def clock(self, timeout: float) -> RoundClock:
        return RoundClock(timeout, self.config.matchmaking_attempt_timeout, self.deadlines)

    async def run(self, request: AverageRequest, view: FlatView) -> AverageResult:
        if request.grid is None:
            out = await self._round(request.key, request, view, request.weight,
                                    self.clock(request.timeout), None, request.group_size)
            return AverageResult((out.record,), None, None, out.spans, out.members, out.owned)
        return await self._grid_rounds(request, view)

    async def _grid_rounds(self, request: AverageRequest, view: FlatView) -> AverageResult:
        grid = request.grid
        assert grid is not None
        run = self.runs.get(request.key)
        if run is not None and run.grid != grid:
            raise GridMismatch(
                f"run {request.key!r} uses grid {run.grid.size}^{run.grid.dims} on this daemon; "
                f"this request asked for {grid.size}^{grid.dims}")
        if run is None:
            run = RunDirectory(self.dht, self.me.peer_id, request.key, grid, self.me.grpc,
                               self.probe)
            self.runs[request.key] = run
        final = timebase.monotonic() + request.timeout
        weight = request.weight
        records: list[tuple[int, RoundOutcome]] = []
        for _ in range(request.rounds):
            plan = await run.plan(request.initial_coords)
            out = None
            try:
                clock = self.clock(final - timebase.monotonic())
                if clock.remaining() <= 0:
                    raise AllreduceError(f"timeout after {len(records)} of {request.rounds} "
                                         "rounds")
                out = await self._round(plan.key, request, view, weight, clock, plan.expected,
                                        grid.size, single_attempt=True,
                                        watcher=run.watcher(plan.round))
            finally:
                await run.finish(plan.round, met=out is None
                                 or out.record.result != "matchmaking_failed")
            records.append((plan.round, out))
            if out.group is None:  # a group of one keeps its value
                weight = carried_weight(weight, 1)
            else:
                weight = carried_weight(sum(m.weight for m in out.group.members),
                                        len(out.group.members))
        assert run.coords is not None
        last = records[-1][1]
        return AverageResult(tuple(o.record for _, o in records), run.coords, records[-1][0],
                             last.spans, last.members, last.owned)

    async def _round(self, key: str, request: AverageRequest, view: FlatView, weight: float,
                     clock: RoundClock, expected: frozenset[bytes] | None, target: int,
                     single_attempt: bool = False, watcher: LineWatcher | None = None
                     ) -> RoundOutcome:
        """One round. In a grid run (`single_attempt`), finding nobody is an outcome (we keep
        our values); for a plain request it is the error the trainer gets."""
        if self.draining():  # e.g. the next round of a multi-round grid request
            raise ShuttingDown("moshpitd is shutting down: it starts no new round")
        start = clock.start
        codec = request.codec
        try:
            group = await self._find(key, request, weight, clock, expected, target,
                                     single_attempt, watcher)
        except GroupNotFound as exc:
            rec = self.rounds.record(key, 1 if isinstance(exc, NoPartners) else 0, 0, 0, start,
                                     timebase.monotonic(),
                                     "alone" if isinstance(exc, NoPartners)
                                     else "matchmaking_failed", codec)
            await _data_in(request, clock)
            await _refuse_alone(view, codec)
            if single_attempt:
                return RoundOutcome(rec)
            raise
        except ShuttingDown:
            self.rounds.record(key, 0, 0, 0, start, timebase.monotonic(), "shutting_down", codec)
            raise
        except BaseException:
            self.rounds.record(key, 0, 0, 0, start, timebase.monotonic(), "matchmaking_failed",
                               codec)
            raise
        assembled = timebase.monotonic()
        log.debug("group %s assembled: %s", group.group_id.hex()[:8],
                  [m.peer_id.hex()[:6] for m in group.members])
        self.metrics.matchmaking_duration.observe(assembled - start)
        self.metrics.group_size.observe(len(group.members))
        n = len(group.members)
        members = tuple(m.peer_id.hex() for m in group.members)
        try:
            await _data_in(request, clock)
        except BaseException:
            self.rounds.record(key, n, 0, 0, start, timebase.monotonic(), "allreduce_failed", codec)
            raise
        if sum(m.weight for m in group.members) <= 0:
            # no weighted mean: every member sees the same weights and keeps its values alike
            await _refuse_alone(view, codec)
            rec = self.rounds.record(key, n, 0, 0, start, assembled, "skipped", codec)
            total = sum(s.numel for s in view.specs)
            return RoundOutcome(rec, group, ((0, total, 0),) if total else (), members)
        try:
            if group.listeners >> group.index_of(self.me.peer_id) & 1:
                # we send nothing (weight 0), so no reducer checks our values: check them here
                await _refuse_alone(view, codec)
            result = await self._allreduce(group, view, clock, request.aggregation)
        except BaseException:
            self.rounds.record(key, n, 0, 0, start, assembled, "allreduce_failed", codec)
            raise
        outcome = "ok" if result.parts_averaged == result.parts else "partial"
        self.metrics.reduced_bytes.inc(result.bytes_reduced)
        for i, m in enumerate(group.members):  # a member that sent its part lives, as a
            if result.excluded >> i & 1:  # probe would show; one we excluded must prove it again
                self.liveness.unprove(m.peer_id)
            elif outcome == "ok":
                self.liveness.vouch(m.peer_id)
        self._partnered(key, group, outcome == "ok")
        rec = self.rounds.record(key, result.group_size, result.bytes_sent,
                                 result.bytes_received, start, assembled, outcome, group.codec,
                                 result.excluded_parts)
        return RoundOutcome(rec, group, result.spans, members, result.owned)

    async def _find(self, key: str, request: AverageRequest, weight: float, clock: RoundClock,
                    expected: frozenset[bytes] | None, target: int, single_attempt: bool,
                    watcher: LineWatcher | None) -> Group:
        attempt = clock.attempt()
        match = MatchRequest(
            key=key, schema_hash=schema_hash(request.specs, request.codec, request.aggregation,
                                               self.config.part_size,
                                               self.registry.handshake.mode == ENCRYPTED,
                                               self.checked),
            weight=weight, target_size=target, min_size=request.min_group_size,
            attempt_seconds=attempt, longest_attempt=clock.attempt_max, expected=expected,
            codec=request.codec, client_mode=self.config.client_mode or self.unreachable,
            settle_seconds=self.settle.seconds,
            rank_digests=request.rank_digests,
            partners=self.partners.get(key, {}) if expected is None else {},
        )
        me = Self(self.me.peer_id, self.me.grpc, self.me.data,  # 0: the rate we measure
                  self.config.bandwidth or self.deadlines.link_mbit, self.me.auth, self.shunned,
                  self.liars, self.liveness, self.peer_rates)
        mm = Matchmaker(me, self.dht, self.pool, match, watcher, self.probe, self.hooks)
        self.matchmakers[key] = mm
        finding = asyncio.ensure_future(mm.find_group(attempt if single_attempt
                                                      else clock.remaining()))
        self.finding[key] = finding
        try:
            group = await finding
        except asyncio.CancelledError:
            this = asyncio.current_task()
            if self.draining() and finding.cancelled() and not (this and this.cancelling()):
                raise ShuttingDown("moshpitd is shutting down: it left this round while "
                                   "matchmaking") from None
            finding.cancel()
            raise
        finally:
            del self.matchmakers[key]
            del self.finding[key]
        if mm.last_join and group.members[0].peer_id == self.me.peer_id:  # we led it
            self.settle.observe(mm.last_join - clock.start)
        return group

    async def _allreduce(self, group: Group, view: FlatView, clock: RoundClock,
                         aggregation: str) -> RoundResult:
        self.on_group(group)
        rnd = ButterflyRound(group, group.index_of(self.me.peer_id), view,
                             get_codec(group.codec), self.registry.connect,
                             self.registry.handshake, self.config.part_size, self.hooks,
                             aggregation, self.config.max_parts_in_flight,
                             sessions=self.registry, checked=self.checked)
        if self.checked and not rnd.plan.checking and not self.warned_unchecked:
            self.warned_unchecked = True  # once: every such round would say the same
            log.warning("%s rounds run unchecked although check_results is on: a member cannot "
                        "recompute it from a few coordinates (docs/security-identity.md, "
                        "\"Checked reductions\")", aggregation)
        self.registry.register(rnd)
        try:
            result = await rnd.run(clock.allreduce(rnd.plan.wire_bytes()))
        finally:
            self.registry.unregister(group.group_id)
        for peer, rate in result.peer_rates:
            self.peer_rates.observe(peer, rate)
        if rnd.plan.checking:
            self._judged(group, set(rnd.plan.by_owner) - {rnd.plan.me}, result)
        clock.learn(result.bytes_sent + result.bytes_received, result.seconds, result.rates,
                    complete=result.parts_averaged == result.parts)
        return result

    def _partnered(self, key: str, group: Group, complete: bool) -> None:
        """Remember whom we averaged with under `key`, if every part was averaged: the next
        round waits a moment for those of them that come late (assembly.PARTNER_WAIT)."""
        self.partners.pop(key, None)
        if complete:
            self.partners[key] = {m.peer_id: m.endpoint for m in group.members
                                  if m.peer_id != self.me.peer_id and not m.client_mode}
            while len(self.partners) > PARTNER_KEYS:
                self.partners.popitem(last=False)

    def _judged(self, group: Group, owners: set[int], result: RoundResult) -> None:
        """Owners whose span failed our check are named, counted and never grouped with
        again (docs/security-identity.md, "Checked reductions")."""
        for index in result.lied:
            peer = group.members[index].peer_id
            self.liars.add(peer)
            log.warning("the result of %s (%s) failed our check in group %s: its span kept "
                        "our values, and we no longer group with it", peer.hex(),
                        group.members[index].endpoint, group.group_id.hex()[:8])
            self.metrics.observe_liar(peer.hex())
        failed = len(owners & set(result.lied))  # (lied also names claimants we caught)
        self.metrics.observe_checks(len(owners) - failed - result.unchecked, failed,
                                    result.unchecked)


async def _data_in(request: AverageRequest, clock: RoundClock) -> None:
    """A pending request's buffer is read only once its trainer said its tensors are in
    (`ready`): they were being copied in, from a GPU say, while we looked for a group. Members
    of our group wait for our parts meanwhile, as for any slow member."""
    ready = request.ready
    if ready is None:
        return
    try:
        if not ready.event.is_set():  # (wait_for with no time left fails even a set event)
            await asyncio.wait_for(ready.event.wait(), max(clock.remaining(), 0.0))
    except TimeoutError:
        raise AllreduceError("the trainer did not say its tensors were in the shared buffer "
                             "('ready') within the request's timeout: nothing of it was "
                             "sent") from None
    if ready.abandoned:
        raise AllreduceError("the trainer abandoned the request before its tensors were in "
                             "the shared buffer: nothing of it was sent")


async def _refuse_alone(view: FlatView, codec: str) -> None:
    """A round without partners never reaches the per-part checks, yet a request with NaN or
    Inf must still be refused (in a grid run, a round alone would keep them)."""
    await asyncio.to_thread(view.check_finite, codec == "fp16")
