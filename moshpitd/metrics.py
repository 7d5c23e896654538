"""Prometheus metrics, served from the daemon's own event loop on a loopback port by default."""

from __future__ import annotations

import asyncio
import functools
import logging
import platform
from collections.abc import Callable, Iterable, Mapping, Sized
from typing import Any, Protocol

import grpc
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from moshpitd import __version__

log = logging.getLogger(__name__)

ROUND_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    """Every series the daemon exports. Names follow Prometheus conventions: `moshpitd_`
    prefix, base units, `_total` on counters, and no peer ids in labels (unbounded)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.rounds = Counter("moshpitd_rounds", "Averaging rounds by result", ["result"],
                              registry=r)
        self.round_duration = Histogram("moshpitd_round_duration_seconds",
                                        "Time from request to averaged result",
                                        buckets=ROUND_BUCKETS, registry=r)
        self.matchmaking_duration = Histogram("moshpitd_matchmaking_duration_seconds",
                                              "Time to assemble a group", buckets=ROUND_BUCKETS,
                                              registry=r)
        self.group_size = Histogram("moshpitd_group_size", "Members of assembled groups",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64), registry=r)
        self.sent_bytes = Counter("moshpitd_sent_bytes", "Tensor bytes sent to peers, by wire "
                                  "codec", ["codec"], registry=r)
        self.received_bytes = Counter("moshpitd_received_bytes", "Tensor bytes from peers, by "
                                      "wire codec", ["codec"], registry=r)
        self.reduced_bytes = Counter(
            "moshpitd_reduced_bytes", "Bytes this daemon received as the owner of a span "
            "(what it reduced for its groups; 0 for a peer that only contributes)", registry=r)
        self.excluded_parts = Counter("moshpitd_excluded_parts", "Parts this peer reduced "
                                      "without a member's contribution, by fault", ["fault"],
                                      registry=r)
        self.loop_lag = Histogram(
            "moshpitd_event_loop_lag_seconds", "How late the event loop woke a 0.1 s timer: "
            "time it was blocked (anything past 0.25 s is also logged as a warning)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5), registry=r)
        self.dht_peers = Gauge("moshpitd_dht_peers", "Contacts in the DHT routing table",
                               registry=r)
        self.ipc_requests = Counter("moshpitd_ipc_requests", "IPC requests by operation and result",
                                    ["op", "result"], registry=r)
        self.ipc_sessions = Gauge("moshpitd_ipc_sessions", "Connected trainer sessions",
                                  registry=r)
        self.draining = Gauge("moshpitd_draining", "1 while the daemon drains after SIGTERM",
                              registry=r)
        self.span_checks = Counter(
            "moshpitd_span_checks", "Other owners' spans checked before they were applied, by "
            "result: passed; failed (the result disagreed with its contributors' signed claims: "
            "the span kept local values and its owner is shunned); unchecked (the check could "
            "not finish: the span kept local values)", ["result"], registry=r)
        for result in ("passed", "failed", "unchecked"):
            self.span_checks.labels(result)
        self.last_liar = Info("moshpitd_check_last_liar", "The last owner whose span failed "
                              "this daemon's check (one series: peer ids are unbounded)",
                              registry=r)
        Info("moshpitd_build", "Build information", registry=r).info({
            "version": __version__, "python": platform.python_version(),
            "grpcio": grpc.__version__})
        for result in ("ok", "partial", "alone", "skipped", "matchmaking_failed",
                       "allreduce_failed", "shutting_down"):
            self.rounds.labels(result)  # every result present from the start, at 0

    def observe_checks(self, passed: int, failed: int, unchecked: int) -> None:
        for result, n in (("passed", passed), ("failed", failed), ("unchecked", unchecked)):
            if n > 0:
                self.span_checks.labels(result).inc(n)

    def observe_liar(self, peer_id: str) -> None:
        self.last_liar.info({"peer_id": peer_id})

    def watch_nat(self, reachable: Callable[[], str], relayed: Callable[[], bool],
                  relay: Any) -> None:
        """Reachability (moshpitd/nat/reach.py) and what this daemon relays for others."""
        r = self.registry
        state = Gauge("moshpitd_reachability", "1 for this daemon's reachability as its last "
                      "check found it: public, private (behind NAT) or unknown", ["state"],
                      registry=r)
        for name in ("public", "private", "unknown"):
            state.labels(name).set_function(functools.partial(_is, reachable, name))
        Gauge("moshpitd_relayed", "1 while peers reach this daemon through a relay",
              registry=r).set_function(lambda: float(relayed()))
        Gauge("moshpitd_relay_reservations", "Private peers this daemon relays for now",
              registry=r).set_function(lambda: relay.reservations)
        r.register(_Count("moshpitd_relay_bytes", "Bytes relayed for private peers, both "
                          "directions", lambda: relay.bytes))
        r.register(_Count("moshpitd_relay_connections", "Connections relayed to private peers",
                          lambda: relay.connections))
        r.register(_LabelledCounts(
            "moshpitd_relay_refused", "Reservations and relayed connections refused, by reason",
            "reason", ("malformed", "unwilling", "full", "per_address", "ports", "connections",
                       "unfetched", "accept"), lambda: relay.refused))

    def watch_liars(self, count: Callable[[], int]) -> None:
        Gauge("moshpitd_check_liars", "Owners this daemon no longer groups with because their "
              "span failed its check", registry=self.registry).set_function(count)

    def observe_round(self, codec: str, sent: int, received: int,
                      excluded: dict[str, int] | None = None) -> None:
        self.sent_bytes.labels(codec).inc(sent)
        self.received_bytes.labels(codec).inc(received)
        for fault, parts in (excluded or {}).items():
            self.excluded_parts.labels(fault).inc(parts)

    def watch_dht(self, peers: Callable[[], int],
                  rpcs: Callable[[], Mapping[tuple[str, str, str], int]],
                  own_id_elsewhere: Callable[[], int] = lambda: 0) -> None:
        """Read at scrape time, so the numbers are never stale."""
        self.dht_peers.set_function(peers)
        self.registry.register(_DHTCollector(rpcs, own_id_elsewhere))

    def watch_auth(self, rejected: Callable[[], Mapping[str, int]]) -> None:
        self.registry.register(_AuthCollector(rejected))

    def watch_dht_store(self, store: DHTStoreStats, records: RecordStats) -> None:
        """The DHT store's size against its bounds, and the records it refused or dropped."""
        Gauge("moshpitd_dht_stored_bytes", "Memory charged to the DHT store (values plus a "
              "fixed cost per record and key), bounded by dht_max_bytes",
              registry=self.registry).set_function(lambda: store.bytes_used)
        Gauge("moshpitd_dht_stored_records", "Subkey records in the DHT store",
              registry=self.registry).set_function(lambda: store.records)
        self.registry.register(_DHTStoreCollector(store, records))

    def watch_joins(self, refused: Callable[[], Mapping[str, int]]) -> None:
        """Join calls refused at once for a bound (join_max_in_flight, join_max_per_peer)."""
        self.registry.register(_LabelledCounts(
            "moshpitd_joins_refused", "Join calls refused because the daemon already held "
            "join_max_in_flight of them, or join_max_per_peer from the asking peer id",
            "limit", ("in_flight", "per_peer"), refused))

    def watch_rates(self, capped: Callable[[], int]) -> None:
        """Declared rates a group this daemon led lowered to what the peer's streams carried."""
        self.registry.register(_Count(
            "moshpitd_declared_rates_capped", "Followers' declared link rates that a group "
            "this daemon led listed lower: at most twice what the follower's streams to this "
            "daemon carried, times the streams its link carried at once", capped))

    def watch_grpc(self, server: GrpcServerStats) -> None:
        """What the gRPC port refused or cut before a peer proved anything (transport/gate.py)."""
        self.registry.register(_LabelledCounts(
            "moshpitd_grpc_refused", "gRPC connections and calls refused or cut by a bound: "
            "connections per address or in total, connections silent 10 s or stalled, calls "
            "per address, responses their caller did not take in time; paced: reads held back "
            "while a connection or identity sent past grpc_receive_rate; accept_rate: "
            "connections past grpc_accept_rate",
            "limit", ("per_address", "total", "silent", "stalled", "paced", "accept_rate",
                      "rpcs_per_address", "write_stalled"), lambda: server.refused))
        Gauge("moshpitd_grpc_connections", "gRPC connections open through the gate",
              registry=self.registry).set_function(
            lambda: server.gate.connections if server.gate is not None else 0)

    def watch_data_plane(self, plane: DataPlaneStats) -> None:
        """Streams the data plane refused, and those waiting for a group it does not hold."""
        Gauge("moshpitd_data_streams_waiting", "Incoming data-plane streams waiting for a "
              "group this daemon does not hold yet (bounded; more are refused as busy)",
              registry=self.registry).set_function(lambda: plane.strangers)
        idle = Gauge("moshpitd_data_sessions_idle", "Data-plane connections kept open between "
                     "streams, by side: opened (ours, for our next stream to that peer) or "
                     "accepted (waiting for the peer's next stream)", ["side"],
                     registry=self.registry)
        idle.labels("opened").set_function(lambda: len(plane.pool))
        idle.labels("accepted").set_function(lambda: len(plane.idle))
        self.registry.register(_DataPlaneCollector(plane))

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))


class _AuthCollector(Collector):
    def __init__(self, rejected: Callable[[], Mapping[str, int]]) -> None:
        self.rejected = rejected

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily("moshpitd_auth_rejected", "Messages refused for a missing "
                                     "or bad swarm-key tag, a stale timestamp or a replay, by "
                                     "plane; dht_record: DHT records not signed by the peer "
                                     "whose id is their subkey, or dated outside the clock "
                                     "window; join: joins that do not prove their peer id; "
                                     "data_handshake: data-plane streams whose handshake does "
                                     "not prove the member they name", labels=["plane"])
        for plane, count in sorted(self.rejected().items()):
            family.add_metric([plane], count)
        yield family


def _is(value: Callable[[], str], name: str) -> float:
    return float(value() == name)


class _Count(Collector):
    """One counter read at scrape time."""

    def __init__(self, name: str, doc: str, count: Callable[[], int]) -> None:
        self.name, self.doc, self.count = name, doc, count

    def collect(self) -> Iterable[Metric]:
        yield CounterMetricFamily(self.name, self.doc, value=self.count())


class _LabelledCounts(Collector):
    """One counter family read at scrape time, every label value present from the start."""

    def __init__(self, name: str, doc: str, label: str, values: tuple[str, ...],
                 counts: Callable[[], Mapping[str, int]]) -> None:
        self.name, self.doc, self.label, self.values, self.counts = name, doc, label, values, counts

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(self.name, self.doc, labels=[self.label])
        counts = self.counts()
        for value in self.values:
            family.add_metric([value], counts.get(value, 0))
        yield family


class GrpcServerStats(Protocol):
    @property
    def refused(self) -> Mapping[str, int]: ...
    @property
    def gate(self) -> Any: ...


class DHTStoreStats(Protocol):
    @property
    def bytes_used(self) -> int: ...
    @property
    def records(self) -> int: ...
    @property
    def evicted(self) -> int: ...
    @property
    def refused_full(self) -> int: ...


class RecordStats(Protocol):
    @property
    def refused(self) -> Mapping[str, int]: ...
    @property
    def verifications(self) -> int: ...


class _DHTStoreCollector(Collector):
    def __init__(self, store: DHTStoreStats, records: RecordStats) -> None:
        self.store = store
        self.records = records

    def collect(self) -> Iterable[Metric]:
        refused = CounterMetricFamily(
            "moshpitd_dht_records_refused", "DHT records refused: unsigned, signed by another "
            "key than the subkey's, a bad signature, a version outside the clock window, "
            "over a bound of the store (full), or from an address bringing new writers faster "
            "than 32 a second (new_writers)", labels=["reason"])
        for reason, count in sorted({**self.records.refused,
                                     "full": self.store.refused_full}.items()):
            refused.add_metric([reason], count)
        yield refused
        yield CounterMetricFamily("moshpitd_dht_records_evicted", "Live DHT records dropped "
                                  "to make room (least recently used keys first)",
                                  value=self.store.evicted)
        yield CounterMetricFamily("moshpitd_dht_signatures_verified", "Ed25519 signatures of "
                                  "DHT records checked (records verified before are not "
                                  "checked again)", value=self.records.verifications)


class DataPlaneStats(Protocol):
    @property
    def strangers(self) -> int: ...
    @property
    def refused(self) -> Mapping[str, int]: ...
    @property
    def streams(self) -> Mapping[tuple[str, str], int]: ...
    @property
    def pool(self) -> Sized: ...
    @property
    def idle(self) -> Sized: ...


class _DataPlaneCollector(Collector):
    def __init__(self, plane: DataPlaneStats) -> None:
        self.plane = plane

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(
            "moshpitd_data_streams_refused", "Incoming data-plane streams refused: busy (no "
            "room to wait for an unknown group; the sender opens it again), identity (its "
            "handshake does not prove it is the member it names), handshake (malformed, stale, "
            "unsealed or another encryption setting), group (no such group in time, its round "
            "over, or not for this member)", labels=["reason"])
        for reason in ("busy", "identity", "handshake", "group"):
            family.add_metric([reason], self.plane.refused.get(reason, 0))
        yield family
        streams = CounterMetricFamily(
            "moshpitd_data_streams", "Data-plane streams, by side (opened: ours to an owner; "
            "accepted: a sender's to us) and how they started (handshake: a new connection "
            "and a signed key exchange; session: on a connection kept from an earlier stream "
            "with the same peer, no connect and no handshake; reversed: on a connection an "
            "owner behind NAT opened to us, a handshake on a direct path)",
            labels=["side", "how"])
        for side, how in (("opened", "handshake"), ("opened", "session"),
                          ("opened", "reversed"), ("accepted", "handshake"),
                          ("accepted", "session")):
            streams.add_metric([side, how], self.plane.streams.get((side, how), 0))
        yield streams


class _DHTCollector(Collector):
    def __init__(self, rpcs: Callable[[], Mapping[tuple[str, str, str], int]],
                 own_id_elsewhere: Callable[[], int]) -> None:
        self.rpcs = rpcs
        self.own_id_elsewhere = own_id_elsewhere

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily("moshpitd_dht_rpcs", "DHT RPCs: received by name, sent "
                                     "(any name) by whether the peer answered, and requests "
                                     "sent again (result resent) when an answer was late; "
                                     "received any dropped_by_kernel: datagrams the kernel "
                                     "dropped at the socket, refused by its filter (not "
                                     "sealed, or from a sender blocked for filling its share "
                                     "of the replay cache) or past its receive buffer; "
                                     "received any sender_unprobed: requests from a sender "
                                     "not in the routing table that was not probed, since "
                                     "the probes' bounds were reached (dht/welcome.py)",
                                     labels=["direction", "rpc", "result"])
        for (direction, rpc, result), count in sorted(self.rpcs().items()):
            family.add_metric([direction, rpc, result], count)
        yield family
        yield CounterMetricFamily(
            "moshpitd_dht_own_id_elsewhere", "DHT requests naming this daemon's peer id from "
            "another daemon: a second daemon runs with this peer key", self.own_id_elsewhere())


class MetricsServer:
    """A minimal HTTP/1.0 responder: GET /metrics, anything else 404."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        self.server = await asyncio.start_server(self._handle, host, port)
        return int(self.server.sockets[0].getsockname()[1])

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(5):
                request = await reader.readuntil(b"\r\n\r\n")
            line = request.split(b"\r\n", 1)[0].split()
            if len(line) >= 2 and line[0] in (b"GET", b"HEAD") and (
                line[1] == b"/metrics" or line[1].startswith(b"/metrics?")
            ):
                body = self.metrics.render()
                head = (f"HTTP/1.1 200 OK\r\nContent-Type: {CONTENT_TYPE_LATEST}\r\n"
                        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
                writer.write(head.encode() + (body if line[0] == b"GET" else b""))
            else:
                writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n"
                             b"Connection: close\r\n\r\n")
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
