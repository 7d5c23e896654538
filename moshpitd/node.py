"""The daemon's core: one averaging request = matchmaking, then a butterfly round."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

import grpc
from grpc import aio

from moshpitd.allreduce.butterfly import AllreduceError, ButterflyRound, RoundResult
from moshpitd.allreduce.codecs import get_codec
from moshpitd.allreduce.deadlines import DeadlinePolicy
from moshpitd.allreduce.group import Group
from moshpitd.allreduce.layout import FlatView, schema_hash
from moshpitd.allreduce.registry import RoundRegistry
from moshpitd.clock import RoundClock, stream_wait
from moshpitd.dht.network import DHTNode
from moshpitd.dht.storage import SubkeyStorage
from moshpitd.hooks import NO_HOOKS, Hooks
from moshpitd.matchmaking.errors import DuplicateRequest, GroupNotFound, NoPartners
from moshpitd.matchmaking.grid import carried_weight
from moshpitd.matchmaking.matchmaker import (
    LineWatcher,
    Matchmaker,
    MatchRequest,
    Self,
    not_looking,
    wait_background,
)
from moshpitd.matchmaking.request import SettlePolicy
from moshpitd.matchmaking.runs import GridMismatch, RunDirectory
from moshpitd.metrics import Metrics
from moshpitd.node_config import NodeConfig, ShuttingDown, format_hostport
from moshpitd.proto import moshpit_pb2 as pb
from moshpitd.rounds import AverageRequest, AverageResult, RoundLog, RoundRecord
from moshpitd.state import StateStore
from moshpitd.transport.grpc_server import AveragerServer, ChannelPool
from moshpitd.transport.security import Security

log = logging.getLogger(__name__)
Outcome = tuple[tuple[tuple[int, int, int], ...], tuple[str, ...], int]  # spans, members, owned


PROBE_TIMEOUT = 1.0
LAG_TICK = 0.1
LAG_WARN = 0.25


class MoshpitNode:
    def __init__(self, config: NodeConfig, metrics: Metrics | None = None,
                 hooks: Hooks = NO_HOOKS) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
        security = Security(config.swarm_key, config.tls)
        self.dht = DHTNode(rpc_timeout=config.dht_rpc_timeout, auth=config.swarm_key,
                           storage=SubkeyStorage(max_subkeys=config.dht_max_records_per_key,
                                                 max_value_bytes=config.dht_max_value_bytes))
        self.pool = ChannelPool(config.max_message, security)
        self.server = AveragerServer(self._handle_join, self._handle_state, config.max_message,
                                     security)
        self.registry = RoundRegistry(config.part_bytes * 2 + 4096, config.swarm_key,
                                     stream_wait(config.matchmaking_seconds))
        self.metrics.watch_auth(lambda: {
            "dht": self.dht.protocol.rpcs["received", "any", "unauthenticated"]
            if getattr(self.dht, "protocol", None) else 0,
            "grpc": security.rejected, "data": self.registry.rejected})
        self.deadlines = DeadlinePolicy()
        self._settle = SettlePolicy()
        self.hooks = hooks  # the fault tests' (service.py installs them)
        self.data_endpoint = ""
        self.matchmakers: dict[str, Matchmaker] = {}
        self.runs: dict[str, RunDirectory] = {}
        self._active: dict[str, asyncio.Task[Any]] = {}  # key -> the request averaging it
        self.log = RoundLog(self.metrics)
        self.dht_addr = ("", 0)
        self.grpc_endpoint = ""
        self._bootstrap_task: asyncio.Task[None] | None = None
        self._lag_task: asyncio.Task[None] | None = None
        self.states: StateStore | None = None
        self.metrics.watch_dht(self.dht.peer_count, lambda: self.dht.protocol.rpcs
                               if getattr(self.dht, "protocol", None) else {})
        self.draining = False
        self._finding: dict[str, asyncio.Task[Group]] = {}  # key -> matchmaking in progress

    @property
    def peer_id(self) -> bytes:
        return self.dht.peer_id

    async def start(self) -> None:
        c = self.config
        self.dht_addr = await self.dht.start(c.dht_host, c.dht_port)
        port = await self.server.start(c.grpc_host, c.grpc_port)
        self.grpc_endpoint = format_hostport(c.advertise_host or c.grpc_host, port)
        dport = await self.registry.start(c.grpc_host, c.data_port)
        self.data_endpoint = format_hostport(c.advertise_host or c.grpc_host, dport)
        self.states = StateStore(self.dht, self.peer_id, self.grpc_endpoint, hooks=self.hooks)
        self._lag_task = asyncio.create_task(self._watch_loop_lag())
        if c.bootstrap:
            await self.dht.join(list(c.bootstrap))
            self._bootstrap_task = asyncio.create_task(self._keep_bootstrapped())

    async def _watch_loop_lag(self) -> None:
        """Anything that blocks the event loop delays every peer's round: make it visible."""
        while True:
            before = time.monotonic()
            await asyncio.sleep(LAG_TICK)
            lag = time.monotonic() - before - LAG_TICK
            if lag > LAG_WARN:
                log.warning("event loop was blocked for %.3f s", lag)

    async def _keep_bootstrapped(self) -> None:
        """A daemon may start before its bootstrap peers: keep trying while alone."""
        delay = 0.5
        while True:
            await asyncio.sleep(delay)
            if self.dht.peer_count() == 0:
                await self.dht.join(list(self.config.bootstrap))
                delay = min(delay * 2, 2.0)  # a few datagrams: rejoin soon after a cut
            else:
                delay = 5.0

    async def drain(self, timeout: float) -> None:
        """Leave the swarm cleanly: rounds still matching are left at once (our followers are
        released, our declarations withdrawn), rounds already averaging finish within
        `timeout`, and our DHT records are withdrawn so nobody waits for us."""
        self.draining = True  # from here no round starts matchmaking (see _one_round)
        await self.server.draining()
        for task in self._finding.values():
            task.cancel("daemon is draining")
        requests = set(self._active.values())
        if requests:
            await asyncio.wait(requests, timeout=timeout)
        for task in requests:
            task.cancel("daemon is draining")
        if requests:  # their cleanup (a grid run's last declaration) before we withdraw
            await asyncio.wait(requests, timeout=1.0)
        withdrawals = [run.leave() for run in self.runs.values()]
        if self.states is not None:
            withdrawals.append(self.states.withdraw_all())
        withdrawals.append(wait_background())
        try:
            async with asyncio.timeout(1.5):
                await asyncio.gather(*withdrawals, return_exceptions=True)
        except TimeoutError:
            log.warning("drain: DHT withdrawals did not finish; the records expire by TTL")
        heard = await self.dht.say_goodbye()
        log.info("drain: %d DHT contact(s) told that we leave", heard)

    async def stop(self) -> None:
        for task in (self._bootstrap_task, self._lag_task):
            if task is not None:
                task.cancel()
        await self.registry.stop()
        await self.server.stop(0.5)
        await self.pool.close()
        self.dht.stop()

    def status(self) -> dict[str, Any]:
        return {
            "peer_id": self.peer_id.hex(),
            "dht": format_hostport(*self.dht_addr),
            "grpc": self.grpc_endpoint,
            "data": self.data_endpoint,
            "dht_peers": self.dht.peer_count(),
            "rounds_done": self.log.done,
            "rounds_failed": self.log.failed,
            "draining": self.draining,
            "active_keys": sorted(self.matchmakers),
            "runs": {name: {"grid": [r.grid.size, r.grid.dims], "coords": r.coords,
                            "round": r.round} for name, r in self.runs.items()},
        }

    async def peers(self) -> dict[str, Any]:
        """DHT contacts, and for each grid run the peers that declared a cell in it."""
        contacts = [{"peer_id": bytes(n.id).hex(), "dht": format_hostport(n.ip, n.port)}
                    for n in self.dht.contacts()]
        runs: dict[str, list[dict[str, Any]]] = {}
        for name, run in self.runs.items():
            entries = await run.peers()
            runs[name] = [{"peer_id": pid.hex(), "coords": list(e.coords), "round": e.round,
                           "grpc": e.endpoint, "joining": e.joining}
                          for pid, e in sorted(entries.items())]
        return {"contacts": contacts, "runs": runs}

    def recent_rounds(self) -> list[dict[str, Any]]:
        return [asdict(r) for r in self.log.recent]

    # --- one averaging request ------------------------------------------------------------
    async def average(self, request: AverageRequest, buffer: memoryview) -> AverageResult:
        view = FlatView(buffer, request.specs)
        total = sum(spec.nbytes for spec in view.specs)
        if total > self.config.max_request_bytes:
            raise ValueError(f"request carries {total} tensor bytes, over this daemon's limit "
                             f"{self.config.max_request_bytes} (setting max_request_bytes)")
        if self.draining:
            raise ShuttingDown("moshpitd is shutting down: it takes no new rounds")
        if request.key in self._active:
            raise DuplicateRequest(f"this daemon is already averaging under key {request.key!r}")
        task = asyncio.current_task()
        assert task is not None
        self._active[request.key] = task
        try:  # NaN, Inf (and values fp16 would turn into Inf): reducers check every part they
            # receive, ButterflyRound our own span; a round spent alone checks everything
            if request.grid is None:
                rec, _, out = await self._one_round(request.key, request, view,
                                                    request.weight, self._clock(request.timeout),
                                                    None, request.group_size)
                return AverageResult((rec,), None, None, *out)
            return await self._grid_rounds(request, view)
        finally:
            del self._active[request.key]

    async def _grid_rounds(self, request: AverageRequest, view: FlatView) -> AverageResult:
        grid = request.grid
        assert grid is not None
        run = self.runs.get(request.key)
        if run is not None and run.grid != grid:
            raise GridMismatch(
                f"run {request.key!r} uses grid {run.grid.size}^{run.grid.dims} on this daemon; "
                f"this request asked for {grid.size}^{grid.dims}"
            )
        if run is None:
            run = RunDirectory(self.dht, self.peer_id, request.key, grid, self.grpc_endpoint,
                               self._probe)
            self.runs[request.key] = run
        final = time.monotonic() + request.timeout
        weight = request.weight
        records: list[tuple[int, RoundRecord]] = []
        out: Outcome = ((), (), 0)  # spans, members, owned of the last round
        for _ in range(request.rounds):
            plan = await run.plan(request.initial_coords)
            try:
                clock = self._clock(final - time.monotonic())
                if clock.remaining() <= 0:
                    raise AllreduceError(f"timeout after {len(records)} of {request.rounds} "
                                         "rounds")
                try:
                    rec, group, out = await self._one_round(
                        plan.key, request, view, weight, clock, plan.expected, grid.size,
                        single_attempt=True, watcher=run.watcher(plan.round))
                    group_weight = sum(m.weight for m in group.members)
                    members = len(group.members)
                except GroupNotFound as exc:  # nobody came: a group of one keeps its value
                    rec, out = exc.record, ((), (), 0)
                    group_weight, members = weight, 1
            finally:
                await run.finish(plan.round)
            records.append((plan.round, rec))
            weight = carried_weight(group_weight, members)
        assert run.coords is not None
        return AverageResult(tuple(r for _, r in records), run.coords, records[-1][0], *out)

    def _clock(self, timeout: float) -> RoundClock:
        return RoundClock(timeout, self.config.matchmaking_seconds, self.deadlines)

    async def _one_round(self, key: str, request: AverageRequest, view: FlatView, weight: float,
                         clock: RoundClock, expected: frozenset[bytes] | None, target: int,
                         single_attempt: bool = False,
                         watcher: LineWatcher | None = None
                         ) -> tuple[RoundRecord, Group, Outcome]:
        if self.draining:  # e.g. the next round of a multi-round grid request
            raise ShuttingDown("moshpitd is shutting down: it starts no new round")
        start = clock.start
        attempt = clock.attempt()
        match = MatchRequest(
            key=key, schema_hash=schema_hash(request.specs, request.codec, request.aggregation,
                                               self.config.part_bytes),
            weight=weight,
            target_size=target, min_size=request.min_group_size,
            attempt_seconds=attempt, expected=expected, codec=request.codec,
            client_mode=self.config.client_mode, settle_seconds=self._settle.seconds,
        )
        me = Self(self.peer_id, self.grpc_endpoint, self.data_endpoint, self.config.bandwidth)
        mm = Matchmaker(me, self.dht, self.pool, match, watcher, self._probe)
        self.matchmakers[key] = mm
        finding = asyncio.ensure_future(mm.find_group(attempt if single_attempt
                                                      else clock.remaining()))
        self._finding[key] = finding
        try:
            try:
                group = await finding
            except asyncio.CancelledError:
                this = asyncio.current_task()
                if self.draining and finding.cancelled() and not (this and this.cancelling()):
                    raise ShuttingDown("moshpitd is shutting down: it left this round while "
                                       "matchmaking") from None
                finding.cancel()
                raise
        except NoPartners as exc:  # the round's record goes with it (to the grid loop)
            exc.record = self.log.record(key, 1, 0, 0, start, time.monotonic(), "alone",
                                         request.codec)
            await self._refuse_alone(view, request.codec)
            raise
        except ShuttingDown:
            self.log.record(key, 0, 0, 0, start, time.monotonic(), "shutting_down", request.codec)
            raise
        except BaseException as exc:
            rec = self.log.record(key, 0, 0, 0, start, time.monotonic(), "matchmaking_failed",
                                  request.codec)
            if isinstance(exc, GroupNotFound):
                exc.record = rec
                await self._refuse_alone(view, request.codec)
            raise
        finally:
            del self.matchmakers[key]
            del self._finding[key]
        assembled = time.monotonic()
        if mm.last_join and group.members[0].peer_id == self.peer_id:  # we led it
            self._settle.observe(mm.last_join - start)
        log.debug("group %s assembled: %s", group.group_id.hex()[:8],
                  [m.peer_id.hex()[:6] for m in group.members])
        self.metrics.matchmaking_duration.observe(assembled - start)
        self.metrics.group_size.observe(len(group.members))
        if sum(m.weight for m in group.members) <= 0:
            self.log.record(key, len(group.members), 0, 0, start, assembled, "allreduce_failed",
                         request.codec)
            raise AllreduceError(f"every member of the group under {key!r} has weight 0: "
                                 "there is no weighted mean")
        try:
            result = await self._allreduce(group, view, clock, request.aggregation)
        except BaseException:
            self.log.record(key, len(group.members), 0, 0, start, assembled, "allreduce_failed",
                         request.codec)
            raise
        outcome = "ok" if result.parts_averaged == result.parts else "partial"
        rec = self.log.record(key, result.group_size, result.bytes_sent, result.bytes_received,
                           start, assembled, outcome, group.codec, result.excluded_parts)
        return rec, group, (result.spans, tuple(m.peer_id.hex() for m in group.members),
                            result.owned)

    @staticmethod
    async def _refuse_alone(view: FlatView, codec: str) -> None:
        """A round without partners never reaches the per-part checks, yet a request with
        NaN or Inf must still be refused (in a grid run, a round alone would keep them)."""
        await asyncio.to_thread(view.check_finite, codec == "fp16")

    async def _allreduce(self, group: Group, view: FlatView, clock: RoundClock,
                         aggregation: str = "mean") -> RoundResult:
        rnd = ButterflyRound(group, group.index_of(self.peer_id), view, get_codec(group.codec),
                             self.registry.connect, self.config.part_bytes, self.hooks,
                             aggregation, self.config.max_parts_in_flight,
                             self.registry.hello if self.config.swarm_key is not None else None)
        self.registry.register(rnd)
        try:
            result = await rnd.run(clock.allreduce(rnd.plan.wire_bytes()))
        finally:
            self.registry.unregister(group.group_id)
        if result.parts_averaged == result.parts:
            clock.learn(result.bytes_sent + result.bytes_received, result.seconds)
        return result

    async def _probe(self, endpoint: str) -> bool:
        """Is a peer's daemon alive? Any answer to Join counts; a refused connection does not."""
        call = self.pool.join(endpoint, pb.JoinRequest(), timeout=PROBE_TIMEOUT)
        try:
            await call.read()
            return True
        except aio.AioRpcError as exc:
            return exc.code() not in (grpc.StatusCode.UNAVAILABLE,
                                      grpc.StatusCode.DEADLINE_EXCEEDED)
        finally:
            call.cancel()

    # --- gRPC handlers --------------------------------------------------------------------
    async def _handle_state(self, request: pb.StateRequest, context: aio.ServicerContext
                            ) -> AsyncIterator[pb.StateChunk]:
        if self.states is None:
            return
        async for chunk in self.states.serve(request, context):
            yield chunk

    async def _handle_join(self, request: pb.JoinRequest,
                           context: aio.ServicerContext) -> AsyncIterator[pb.JoinResponse]:
        mm = self.matchmakers.get(request.group_key)
        if mm is None:
            yield not_looking(request.group_key)
            return
        async for response in mm.handle_join(request):
            yield response

