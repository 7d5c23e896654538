"""The daemon's core: one averaging request = matchmaking, then a butterfly round."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc
from grpc import aio

from moshpitd.allreduce.butterfly import AllreduceError, ButterflyRound, RoundResult
from moshpitd.allreduce.codecs import get_codec
from moshpitd.allreduce.faults import FaultPlan
from moshpitd.allreduce.group import Group
from moshpitd.allreduce.layout import DEFAULT_PART_BYTES, FlatView, TensorSpec, schema_hash
from moshpitd.allreduce.registry import DeadlinePolicy, RoundRegistry
from moshpitd.dht.network import DHTNode
from moshpitd.matchmaking.errors import DuplicateRequest, GroupNotFound, NoPartners
from moshpitd.matchmaking.grid import Grid, carried_weight
from moshpitd.matchmaking.matchmaker import (
    LineWatcher,
    Matchmaker,
    MatchRequest,
    Self,
    not_looking,
)
from moshpitd.matchmaking.request import SettlePolicy
from moshpitd.matchmaking.runs import GridMismatch, RunDirectory
from moshpitd.metrics import Metrics
from moshpitd.proto import moshpit_pb2 as pb
from moshpitd.state import StateStore
from moshpitd.transport.grpc_server import DEFAULT_MAX_MESSAGE, AveragerServer, ChannelPool

log = logging.getLogger(__name__)

PROBE_TIMEOUT = 1.0
LAG_TICK = 0.1
LAG_WARN = 0.25


def format_hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class NodeConfig:
    dht_host: str = "127.0.0.1"
    dht_port: int = 0
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 0
    data_port: int = 0  # the data plane listens on grpc_host
    bandwidth: float = 1.0  # relative share of each vector this peer offers to reduce
    client_mode: bool = False
    bootstrap: tuple[tuple[str, int], ...] = ()
    dht_rpc_timeout: float = 1.0
    part_bytes: int = DEFAULT_PART_BYTES
    max_message: int = DEFAULT_MAX_MESSAGE
    matchmaking_seconds: float = 5.0


@dataclass(frozen=True)
class AverageRequest:
    key: str
    specs: tuple[TensorSpec, ...]
    weight: float = 1.0
    timeout: float = 30.0
    group_size: int = 16
    min_group_size: int = 2
    grid: Grid | None = None
    rounds: int = 1
    initial_coords: tuple[int, ...] | None = None
    codec: str = "none"


@dataclass(frozen=True)
class AverageResult:
    rounds: tuple[RoundRecord, ...]
    coords: tuple[int, ...] | None
    last_round: int | None
    spans: tuple[tuple[int, int, int], ...] = ()  # of the last all-reduce: start, stop, mask
    members: tuple[str, ...] = ()  # peer ids of the last group, in mask bit order
    owned: int = 0  # elements this peer reduced in the last all-reduce

    @property
    def last(self) -> RoundRecord:
        return self.rounds[-1]


@dataclass(frozen=True)
class RoundRecord:
    key: str
    group_size: int
    bytes_sent: int
    bytes_received: int
    seconds: float
    matchmaking_seconds: float
    result: str
    finished: float = field(default_factory=time.time)


class MoshpitNode:
    def __init__(self, config: NodeConfig, metrics: Metrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
        self.dht = DHTNode(rpc_timeout=config.dht_rpc_timeout)
        self.pool = ChannelPool(config.max_message)
        self.server = AveragerServer(self._handle_join, self._handle_state, config.max_message)
        self.registry = RoundRegistry(config.part_bytes * 2 + 4096)
        self.deadlines = DeadlinePolicy()
        self._settle = SettlePolicy()
        self.fault = FaultPlan.from_env()
        self.data_endpoint = ""
        self.matchmakers: dict[str, Matchmaker] = {}
        self.runs: dict[str, RunDirectory] = {}
        self._active: set[str] = set()
        self._last_spans: tuple[tuple[int, int, int], ...] = ()
        self._last_members: tuple[str, ...] = ()
        self._last_owned = 0
        self.recent: deque[RoundRecord] = deque(maxlen=100)
        self.rounds_done = 0
        self.rounds_failed = 0
        self.dht_addr = ("", 0)
        self.grpc_endpoint = ""
        self._bootstrap_task: asyncio.Task[None] | None = None
        self._lag_task: asyncio.Task[None] | None = None
        self.states: StateStore | None = None

    @property
    def peer_id(self) -> bytes:
        return self.dht.peer_id

    async def start(self) -> None:
        c = self.config
        self.dht_addr = await self.dht.start(c.dht_host, c.dht_port)
        port = await self.server.start(c.grpc_host, c.grpc_port)
        self.grpc_endpoint = format_hostport(c.grpc_host, port)
        dport = await self.registry.start(c.grpc_host, c.data_port)
        self.data_endpoint = format_hostport(c.grpc_host, dport)
        self.states = StateStore(self.dht, self.peer_id, self.grpc_endpoint)
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
            self.metrics.dht_peers.set(self.dht.peer_count())
            if self.dht.peer_count() == 0:
                await self.dht.join(list(self.config.bootstrap))
                delay = min(delay * 2, 10.0)
            else:
                delay = 5.0

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
            "rounds_done": self.rounds_done,
            "rounds_failed": self.rounds_failed,
            "active_keys": sorted(self.matchmakers),
            "runs": {name: {"grid": [r.grid.size, r.grid.dims], "coords": r.coords,
                            "round": r.round} for name, r in self.runs.items()},
        }

    def recent_rounds(self) -> list[dict[str, Any]]:
        return [asdict(r) for r in self.recent]

    # --- one averaging request ------------------------------------------------------------
    async def average(self, request: AverageRequest, buffer: memoryview) -> AverageResult:
        view = FlatView(buffer, request.specs)
        view.check_finite()  # NaN or Inf is refused here, before it reaches any peer
        if request.key in self._active:
            raise DuplicateRequest(f"this daemon is already averaging under key {request.key!r}")
        self._active.add(request.key)
        try:
            if request.grid is None:
                rec, _ = await self._one_round(request.key, request, view, request.weight,
                                               request.timeout, None, request.group_size)
                return AverageResult((rec,), None, None, self._last_spans, self._last_members,
                                     self._last_owned)
            return await self._grid_rounds(request, view)
        finally:
            self._active.discard(request.key)

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
        for _ in range(request.rounds):
            plan = await run.plan(request.initial_coords)
            try:
                remaining = final - time.monotonic()
                if remaining <= 0:
                    raise AllreduceError(f"timeout after {len(records)} of {request.rounds} "
                                         "rounds")
                try:
                    rec, group = await self._one_round(
                        plan.key, request, view, weight, remaining, plan.expected, grid.size,
                        single_attempt=True, watcher=run.watcher(plan.round))
                    group_weight = sum(m.weight for m in group.members)
                    members = len(group.members)
                except GroupNotFound:  # nobody came: a group of one keeps its value
                    rec = self.recent[-1]
                    group_weight, members = weight, 1
            finally:
                await run.finish(plan.round)
            records.append((plan.round, rec))
            weight = carried_weight(group_weight, members)
        assert run.coords is not None
        return AverageResult(tuple(r for _, r in records), run.coords, records[-1][0],
                             self._last_spans, self._last_members, self._last_owned)

    async def _one_round(self, key: str, request: AverageRequest, view: FlatView, weight: float,
                         timeout: float, expected: frozenset[bytes] | None, target: int,
                         single_attempt: bool = False,
                         watcher: LineWatcher | None = None) -> tuple[RoundRecord, Group]:
        start = time.monotonic()
        final = start + timeout
        attempt = min(self.config.matchmaking_seconds, timeout)
        match = MatchRequest(
            key=key, schema_hash=schema_hash(request.specs, request.codec), weight=weight,
            target_size=target, min_size=request.min_group_size,
            attempt_seconds=attempt, expected=expected, codec=request.codec,
            client_mode=self.config.client_mode, settle_seconds=self._settle.seconds,
        )
        me = Self(self.peer_id, self.grpc_endpoint, self.data_endpoint, self.config.bandwidth)
        mm = Matchmaker(me, self.dht, self.pool, match, watcher)
        self.matchmakers[key] = mm
        try:
            group = await mm.find_group(attempt if single_attempt else timeout)
        except NoPartners:
            self._last_spans, self._last_members = (), ()
            self._record(key, 1, 0, 0, start, time.monotonic(), "alone")
            raise
        except BaseException:
            self._record(key, 0, 0, 0, start, time.monotonic(), "matchmaking_failed")
            raise
        finally:
            del self.matchmakers[key]
        assembled = time.monotonic()
        if mm.last_join and group.members[0].peer_id == self.peer_id:  # we led it
            self._settle.observe(mm.last_join - start)
        log.debug("group %s assembled: %s", group.group_id.hex()[:8],
                  [m.peer_id.hex()[:6] for m in group.members])
        self.metrics.matchmaking_duration.observe(assembled - start)
        self.metrics.group_size.observe(len(group.members))
        if sum(m.weight for m in group.members) <= 0:
            self._record(key, len(group.members), 0, 0, start, assembled, "allreduce_failed")
            raise AllreduceError(f"every member of the group under {key!r} has weight 0: "
                                 "there is no weighted mean")
        result = await self._allreduce(group, view, final)
        self._last_spans = result.spans
        self._last_members = tuple(m.peer_id.hex() for m in group.members)
        self._last_owned = result.owned
        outcome = "ok" if result.parts_averaged == result.parts else "partial"
        rec = self._record(key, result.group_size, result.bytes_sent, result.bytes_received,
                           start, assembled, outcome)
        return rec, group

    async def _allreduce(self, group: Group, view: FlatView, final: float) -> RoundResult:
        self.fault.begin_round()
        rnd = ButterflyRound(group, group.index_of(self.peer_id), view,
                             get_codec(group.codec), self.registry.connect,
                             self.config.part_bytes, self.fault)
        n = len(group.members)
        moved = 2 * sum(view.specs[i].nbytes for i in range(len(view.specs))) * (n - 1) // n
        budget = self.deadlines.budget(moved)
        remaining = final - time.monotonic()
        grace = min(1.0, 0.25 * budget)
        deadline = time.monotonic() + max(min(budget, remaining - grace), 0.05)
        self.registry.register(rnd)
        try:
            result = await rnd.run(deadline, grace)
        finally:
            self.registry.unregister(group.group_id)
        if result.parts_averaged == result.parts:
            self.deadlines.observe(result.bytes_sent + result.bytes_received, result.seconds)
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

    def _record(self, key: str, size: int, sent: int, received: int, start: float,
                assembled: float, result: str) -> RoundRecord:
        now = time.monotonic()
        rec = RoundRecord(key, size, sent, received, now - start, assembled - start, result)
        self.recent.append(rec)
        self.metrics.rounds.labels(result).inc()
        self.metrics.round_duration.observe(now - start)
        self.metrics.sent_bytes.inc(sent)
        self.metrics.received_bytes.inc(received)
        if result in ("ok", "alone"):
            self.rounds_done += 1
            log.info("round key=%s group=%d sent=%d recv=%d mm=%.3fs total=%.3fs", key, size,
                     sent, received, assembled - start, now - start)
        else:
            self.rounds_failed += 1
            log.info("round key=%s result=%s after %.3fs", key, result, now - start)
        return rec

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


def specs_from_wire(tensors: Sequence[Any]) -> tuple[TensorSpec, ...]:
    """Validate the IPC description of tensors: [[dtype, shape, offset], ...]."""
    specs = []
    for i, t in enumerate(tensors):
        if not (isinstance(t, list | tuple) and len(t) == 3):
            raise ValueError(f"tensor {i}: expected [dtype, shape, offset]")
        dtype, shape, offset = t
        if not isinstance(dtype, str) or not isinstance(offset, int) or isinstance(offset, bool):
            raise ValueError(f"tensor {i}: dtype must be a string and offset an integer")
        if not isinstance(shape, list | tuple) or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in shape
        ) or len(shape) > 32:
            raise ValueError(f"tensor {i}: shape must be a list of at most 32 integers")
        specs.append(TensorSpec(dtype, tuple(shape), offset))
    return tuple(specs)
