"""The daemon's core: it wires the DHT, gRPC, the data plane and state sharing together, and
owns the lifecycle (start, bootstrap, drain, status). Requests run in runner.py."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import asdict, replace
from typing import Any

from moshpitd import timebase
from moshpitd.allreduce.layout import FlatView
from moshpitd.allreduce.registry import REFUSED_IDENTITY, RoundRegistry
from moshpitd.clock import stream_wait
from moshpitd.dht.network import DHTNode
from moshpitd.dht.storage import SubkeyStorage
from moshpitd.hooks import NO_HOOKS, Hooks
from moshpitd.local.group import LocalGroups
from moshpitd.matchmaking.admission import JoinAdmission
from moshpitd.matchmaking.declaration import wait_background
from moshpitd.matchmaking.errors import DuplicateRequest
from moshpitd.matchmaking.liveness import Liveness
from moshpitd.matchmaking.matchmaker import Matchmaker, not_looking
from moshpitd.matchmaking.runs import RunDirectory
from moshpitd.matchmaking.signing import (
    PeerAuth,
    is_probe,
    probe_request,
    proves_peer,
    tls_binding_of,
)
from moshpitd.metrics import Metrics
from moshpitd.nat.relay import RelayLimits
from moshpitd.nat.service import Nat
from moshpitd.nat.tunnel import Reserved, no_gate
from moshpitd.node_config import NodeConfig, ShuttingDown, format_hostport
from moshpitd.proto import moshpit_pb2 as pb
from moshpitd.rounds import AverageRequest, AverageResult, RoundLog
from moshpitd.runner import Endpoints, RoundRunner
from moshpitd.state import StateStore
from moshpitd.transport.control import Caller, ControlError, ControlPlane
from moshpitd.transport.gate import GateLimits
from moshpitd.transport.grpc_server import ServerLimits, grpc_plane
from moshpitd.transport.handshake import Handshake
from moshpitd.transport.security import Security

log = logging.getLogger(__name__)

# The node's own timing, not a round's: none depends on a request or on link speed.
PROBE_TIMEOUT = 1.0  # s: a live daemon answers a Join at once on any link we would average over
LAG_TICK = 0.1  # s between event-loop lag samples
LAG_WARN = 0.25  # s of blocked loop worth a warning: a round's start wait at the budget floor
REJOIN_FIRST, REJOIN_MAX = 0.5, 2.0  # s: DHT rejoin backoff while alone (a few datagrams each)
REJOIN_CHECK = 5.0  # s between checks once we have contacts
DRAIN_CLEANUP = 1.0  # s for cancelled requests' cleanup (a grid run's last declaration)
DRAIN_WITHDRAW = 1.5  # s for DHT withdrawals; what is left expires by TTL
STOP_GRACE = 0.5  # s for in-flight gRPC calls when stopping
FIRST_CHECK = 5.0  # s a bootstrapped daemon's start waits for its first reachability verdict


class MoshpitNode:
    def __init__(self, config: NodeConfig, metrics: Metrics | None = None,
                 hooks: Hooks = NO_HOOKS, control: ControlPlane | None = None) -> None:
        """`control`: the control plane (gRPC unless a simulated network gives its own)."""
        self.config = config
        self.metrics = metrics or Metrics()
        security = Security(config.swarm_key, config.tls)
        # who answered our probes: matchmaking follows and waits for them, and their records
        # keep their places under a key that throw-away identities flood
        self.liveness = Liveness(self._probe)
        self.liveness.known = self._is_contact
        self.dht = DHTNode(rpc_timeout=config.dht_rpc_timeout, auth=config.swarm_key,
                           identity=config.identity,
                           storage=SubkeyStorage(max_subkeys=config.dht_max_records_per_key,
                                                 max_value_bytes=config.dht_max_value_bytes,
                                                 max_bytes=config.dht_max_bytes,
                                                 max_per_writer=config.dht_max_records_per_peer,
                                                 protected=self._protected))
        control = control or grpc_plane(config.max_message_bytes, security, ServerLimits(
            GateLimits(config.grpc_max_connections_per_address, config.grpc_max_connections,
                       rate=config.grpc_receive_rate, burst=config.grpc_receive_burst,
                       accept_rate=config.grpc_accept_rate, accept_burst=config.grpc_accept_burst),
            config.grpc_max_calls_per_address, config.grpc_write_timeout))
        self.server, self.pool = control(self._handle_join, self._handle_state)
        self.metrics.watch_grpc(self.server)
        # identity is always on; encryption whenever a swarm key or TLS says the network is
        # not trusted, unless the operator turned it off
        encrypt = config.data_encryption == "auto" and (config.swarm_key is not None
                                                        or config.tls is not None)
        self.auth = PeerAuth(self.dht.identity, config.tls.cert if config.tls else None)
        self.registry = RoundRegistry(
            config.part_size * 2 + 4096,
            Handshake(self.dht.identity, config.swarm_key, encrypt),
            stream_wait(config.matchmaking_attempt_timeout),
            congestion="" if config.data_congestion_control == "system"
            else config.data_congestion_control)
        self.metrics.watch_auth(lambda: {
            "dht": self.dht.protocol.rpcs["received", "any", "unauthenticated"]
            if getattr(self.dht, "protocol", None) else 0,
            "grpc": security.rejected, "data": self.registry.rejected,
            "data_handshake": self.registry.refused[REFUSED_IDENTITY],
            "join": self.auth.refused,
            "dht_record": sum(self.dht.verifier.refused.values())})
        self.metrics.watch_dht_store(self.dht.storage, self.dht.verifier)
        self.metrics.watch_data_plane(self.registry)
        self.hooks = hooks  # the fault tests' (service.py installs them)
        self.joins = JoinAdmission(config.join_max_in_flight, config.join_max_per_peer)
        self.metrics.watch_joins(lambda: self.joins.refused)
        self.data_endpoint = ""
        self._active: dict[str, asyncio.Task[Any]] = {}  # key -> the request averaging it
        self.log = RoundLog(self.metrics)
        self.dht_addr = ("", 0)
        self.grpc_endpoint = ""
        self._bootstrap_task: asyncio.Task[None] | None = None
        self._lag_task: asyncio.Task[None] | None = None
        self.states: StateStore | None = None
        self.metrics.watch_dht(
            self.dht.peer_count,
            self.dht.rpc_counts,
            lambda: self.dht.protocol.own_id_elsewhere
            if getattr(self.dht, "protocol", None) else 0)
        self.draining = False
        self._runner: RoundRunner | None = None
        self.nat = Nat(config.reachability, self.dht, self.dht.identity, config.swarm_key,
                       RelayLimits(reservations=config.relay_max_reservations,
                                   rate=config.relay_rate * 1e6 / 8),
                       config.relay, self._reached_at,
                       None if hooks is NO_HOOKS else hooks.relayed)
        self.metrics.watch_nat(lambda: self.nat.state, lambda: self.nat.reserved is not None,
                               self.nat.relay)
        self._own = ("", "")  # our own gRPC and data endpoints, as we listen
        self.local = LocalGroups(self._average_view, lambda timeout: self.runner.clock(timeout),
                                 lambda key: key in self._active)

    @property
    def peer_id(self) -> bytes:
        return self.dht.peer_id

    @property
    def runner(self) -> RoundRunner:
        if self._runner is None:
            raise RuntimeError("the node runs requests once started")
        return self._runner

    @property
    def matchmakers(self) -> dict[str, Matchmaker]:
        return self._runner.matchmakers if self._runner is not None else {}

    @property
    def runs(self) -> dict[str, RunDirectory]:
        return self._runner.runs if self._runner is not None else {}

    async def start(self) -> None:
        c = self.config
        self.dht_addr = await self.dht.start(*c.dht_listen)
        self.dht.protocol.nat = self.nat  # peers' reachability checks, from the first datagram
        grpc_host, grpc_port = c.grpc_listen
        port = await self.server.start(grpc_host, grpc_port)
        self.grpc_endpoint = format_hostport(c.advertise_host or grpc_host, port)
        dport = await self.registry.start(grpc_host, c.data_port)
        self.data_endpoint = format_hostport(c.advertise_host or grpc_host, dport)
        self._own = (self.grpc_endpoint, self.data_endpoint)
        self.states = StateStore(self.dht, self.peer_id, self.grpc_endpoint, hooks=self.hooks)
        self._runner = RoundRunner(c, Endpoints(self.peer_id, self.grpc_endpoint,
                                                self.data_endpoint, self.auth),
                                   self.dht, self.pool, self.registry, self.hooks, self.metrics,
                                   self.log, self.liveness, lambda: self.draining)
        self._lag_task = asyncio.create_task(self._watch_loop_lag())
        self.registry.relay = self.nat.on_relay_step
        gate = self.server.gate
        if gate is not None:
            gate.on_reach = lambda nonce: self.nat.reached(nonce, "grpc")
        if c.bootstrap:
            await self.dht.join(list(c.bootstrap))
            self._bootstrap_task = asyncio.create_task(self._keep_bootstrapped())
        if c.reachability == "private":  # a client until its first relay
            self._set_endpoints(*self._own, unreachable=True)
        self.nat.start(grpc_host, (self.dht_addr[1], port, dport),  # its first check at once
                       gate.serve if gate is not None else no_gate, self.registry.accept,
                       self.registry.pool, (grpc_host, c.advertise_host, self.dht_addr[0]),
                       lambda: [r.channel for r in self.registry.idle])
        self.registry.offers = self.nat.reverse
        if c.direct_paths:
            self._runner.on_group = self.nat.offer_direct
        if self.nat.first_pending:  # until the first check says: a client
            self.runner.unreachable = True
            await self.nat.first_check(FIRST_CHECK)

    def _reached_at(self, reserved: Reserved | None, observed: str) -> None:
        """Peers reach us through a relay's ports, or our own (at the address the check saw,
        unless the operator named one): moshpitd/nat/service.py."""
        grpc, data = self._own
        if reserved is not None:
            grpc, data = reserved.grpc, reserved.data
        elif observed and "advertise_host" not in self.config.sources:
            grpc = format_hostport(observed, int(grpc.rpartition(":")[2]))
            data = format_hostport(observed, int(data.rpartition(":")[2]))
        self._set_endpoints(grpc, data, unreachable=reserved is None and self.nat.state ==
                            "private")

    def _set_endpoints(self, grpc: str, data: str, unreachable: bool) -> None:
        runner = self.runner
        runner.unreachable = unreachable
        if (grpc, data) == (self.grpc_endpoint, self.data_endpoint):
            return
        self.grpc_endpoint, self.data_endpoint = grpc, data
        runner.me = replace(runner.me, grpc=grpc, data=data)
        for run in runner.runs.values():
            run.endpoint = grpc
        if self.states is not None:
            self.states.endpoint = grpc
        log.info("peers reach us at %s (gRPC) and %s (data)", grpc, data)

    async def _watch_loop_lag(self) -> None:
        """Anything that blocks the event loop delays every peer's round: make it visible."""
        while True:
            before = timebase.monotonic()
            await asyncio.sleep(LAG_TICK)
            lag = timebase.monotonic() - before - LAG_TICK
            self.metrics.loop_lag.observe(max(lag, 0.0))
            if lag > LAG_WARN:
                log.warning("event loop was blocked for %.3f s", lag)

    async def _keep_bootstrapped(self) -> None:
        """A daemon may start before its bootstrap peers: keep trying while alone."""
        delay = REJOIN_FIRST
        while True:
            await asyncio.sleep(delay)
            if self.dht.peer_count() == 0:
                await self.dht.join(list(self.config.bootstrap))
                delay = min(delay * 2, REJOIN_MAX)  # rejoin soon after a cut
            else:
                delay = REJOIN_CHECK

    async def drain(self, timeout: float) -> None:
        """Leave the swarm cleanly: rounds still matching are left at once (our followers are
        released, our declarations withdrawn), rounds already averaging finish within
        `timeout`, and our DHT records are withdrawn so nobody waits for us."""
        self.draining = True  # from here no round starts matchmaking (see RoundRunner)
        self.local.drain()
        await self.server.draining()
        for task in self._runner.finding.values() if self._runner is not None else ():
            task.cancel("daemon is draining")
        requests = set(self._active.values())
        if requests:
            await asyncio.wait(requests, timeout=timeout)
        for task in requests:
            task.cancel("daemon is draining")
        if requests:  # their cleanup (a grid run's last declaration) before we withdraw
            await asyncio.wait(requests, timeout=DRAIN_CLEANUP)
        withdrawals = [run.leave() for run in self.runs.values()]
        if self.states is not None:
            withdrawals.append(self.states.withdraw_all())
        withdrawals.append(wait_background())
        try:
            async with asyncio.timeout(DRAIN_WITHDRAW):
                await asyncio.gather(*withdrawals, return_exceptions=True)
        except TimeoutError:
            log.warning("drain: DHT withdrawals did not finish; the records expire by TTL")
        heard = await self.dht.say_goodbye()
        log.info("drain: %d DHT contact(s) told that we leave", heard)

    async def stop(self) -> None:
        for task in (self._bootstrap_task, self._lag_task):
            if task is not None:
                task.cancel()
        await self.nat.close()
        await self.registry.stop()
        await self.liveness.close()
        await self.server.stop(STOP_GRACE)
        await self.pool.close()
        self.dht.stop()

    def status(self) -> dict[str, Any]:
        return {
            "peer_id": self.peer_id.hex(),
            "dht": format_hostport(*self.dht_addr),
            "grpc": self.grpc_endpoint,
            "data": self.data_endpoint,
            "dht_peers": self.dht.peer_count(),
            "reachability": self.nat.status(),
            "rounds_done": self.log.done,
            "rounds_failed": self.log.failed,
            "draining": self.draining,
            "active_keys": sorted(self.matchmakers),
            "local_groups": self.local.status(),
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
        if request.local_world is not None:  # one of this host's trainers (moshpitd/local/)
            self._admit(request, view)
            return await self.local.join(request, view, buffer)
        if self.local.holds(request.key):
            raise DuplicateRequest(f"this daemon's local trainers are averaging under key "
                                   f"{request.key!r}: pass local_world like them")
        return await self._average_view(request, view)

    def _admit(self, request: AverageRequest, view: FlatView) -> None:
        total = sum(spec.nbytes for spec in view.specs)
        if total > self.config.max_request_bytes:
            raise ValueError(f"request carries {total} tensor bytes, over this daemon's limit "
                             f"{self.config.max_request_bytes} (setting max_request_bytes)")
        if self.draining:
            raise ShuttingDown("moshpitd is shutting down: it takes no new rounds")

    async def _average_view(self, request: AverageRequest, view: FlatView) -> AverageResult:
        """One peer's request with the swarm: a trainer's, or a local group's."""
        self._admit(request, view)
        if request.key in self._active:
            raise DuplicateRequest(f"this daemon is already averaging under key {request.key!r}")
        task = asyncio.current_task()
        assert task is not None
        self._active[request.key] = task
        try:
            await self.nat.settled()
            # NaN, Inf (and values fp16 would turn into Inf): reducers check every part they
            # receive, ButterflyRound our own span; a round spent alone checks everything
            return await self.runner.run(request, view)
        finally:
            del self._active[request.key]

    def _is_contact(self, peer_id: bytes) -> bool:
        """A DHT contact that answered our calls under the swarm key (probed first: a
        throw-away identity that only sent us datagrams is no contact)."""
        proto = getattr(self.dht, "protocol", None)
        return proto is not None and proto.is_contact(peer_id)

    def _protected(self, writer: bytes) -> bool:
        """Records that keep their places under a full key: ours, and live peers'."""
        return writer == self.dht.identity.peer_id or self.liveness.proven(writer)

    async def _probe(self, endpoint: str, peer_id: bytes) -> bool:
        """Is the peer declared at `endpoint` alive? Only its signature over our nonce says so:
        an address that answers (say, another live daemon's, named in a made-up declaration)
        proves nothing."""
        request = probe_request()
        call = self.pool.join(endpoint, request, timeout=PROBE_TIMEOUT)
        try:
            answer = await call.read()
            return answer is not None and proves_peer(answer, request.nonce, peer_id)
        except ControlError:
            return False
        finally:
            call.cancel()

    # --- gRPC handlers --------------------------------------------------------------------
    async def _handle_state(self, request: pb.StateRequest, caller: Caller
                            ) -> AsyncIterator[pb.StateChunk]:
        if self.states is None:
            return
        async for chunk in self.states.serve(request):
            yield chunk

    def _vouch(self, request: pb.JoinRequest, binding: bytes, peer: str) -> None:
        """A join from a peer that proved its liveness, signed: its connection's bytes count
        against its identity from now on, not its address (transport/gate.py). One signature
        check per connection, and only for proven peers."""
        gate = self.server.gate
        if (gate is not None and self.liveness.proven(request.peer_id)
                and not gate.vouched(peer) and self.auth.proves_sender(request, binding)):
            gate.vouch(peer, request.peer_id)

    async def _handle_join(self, request: pb.JoinRequest,
                           caller: Caller) -> AsyncIterator[pb.JoinResponse]:
        if is_probe(request):
            yield self.auth.answer_probe(request)
            return
        # over TLS, a join must be signed for the certificate its caller presented
        binding = tls_binding_of(caller.certificate) if self.config.tls is not None else b""
        self._vouch(request, binding, caller.address)
        mm = self.matchmakers.get(request.group_key)
        if mm is None:
            yield not_looking(request.group_key)
            return
        async for response in mm.handle_join(request, binding, self.joins):
            yield response
