"""The fuzzed daemon and its health checks, shared by the fuzz test modules (see the
package docstring)."""

from __future__ import annotations

import collections
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
import torch
import umsgpack
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, settings
from kademlia.utils import digest

import moshpit
from moshpitd.allreduce.layout import schema_hash, specs_from_wire
from moshpitd.launcher import DaemonProcess, LocalSwarm
from tests.integration.helpers import run_parallel

EXAMPLES = int(os.environ.get("MOSHPIT_FUZZ_EXAMPLES", "2000"))
CHECK_EVERY = 500
RSS_HEADROOM = 200 << 20
FD_HEADROOM = 64
SESSION_END_TIMEOUT = 5.0  # after we hang up, the daemon must close the IPC session by then
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))

STATE_KEY = "fuzz-state"
LURE_KEY = "fuzz-lure"
LURE_TENSORS = [["float32", [4], 0]]
LURE_SCHEMA = schema_hash(specs_from_wire(LURE_TENSORS), "none")
CHECK_ELEMS = 1000
CHECK_SCHEMA = schema_hash(specs_from_wire([["float32", [CHECK_ELEMS], 0]]), "none")
FUZZ_NODE_ID = b"\xf0" * 20
MAX_DATAGRAM = 65507
JOIN = "/moshpit.Averager/Join"
DOWNLOAD_STATE = "/moshpit.Averager/DownloadState"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
# log lines that mean a daemon bug: a handler exception, an unowned task that died
BAD_LOG_MARKERS = ("Traceback (most recent call last)", "exception was never retrieved",
                   "Exception in callback", "InternalError")
# Log signatures of known, not yet fixed daemon bugs the checks tolerate (none at present).
KNOWN_BUGS: dict[str, str] = {}


def grpc_decode_error(text: str) -> bool:
    """grpc's own answer to a request body that does not parse: the handler never ran."""
    return "DecodeError" in text and ("cygrpc.deserialize" in text or "Unexpected <class "
                                      "'google.protobuf.message.DecodeError'>" in text)


def bad_log_entries(text: str) -> list[str]:
    """Tracebacks and other error reports in a daemon log, each with its context."""
    lines = text.splitlines()
    out = []
    i = 0
    while i < len(lines):
        if not any(m in lines[i] for m in BAD_LOG_MARKERS):
            i += 1
            continue
        end = i + 1  # a traceback runs until the next timestamped log line
        while end < len(lines) and not lines[end][:4].isdigit():
            end += 1
        entry = "\n".join(lines[max(i - 2, 0):end])
        if not (grpc_decode_error(entry) or any(sig in entry for sig in KNOWN_BUGS)):
            out.append(entry)
        i = end
    return out


def check_key(n: int) -> str:
    return f"fuzz-check-{n}"


def find_subs(dht: str, key: str) -> Any:
    """A DHT node's records under a key, asked as a peer would: [[subkey, value, version,
    ttl], ...], or what went wrong."""
    host, port = dht.rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(2.0)
        msg_id = os.urandom(20)
        sock.sendto(b"\x00" + msg_id + umsgpack.packb(
            ["find_subs", [FUZZ_NODE_ID, digest(key)]]), (host, int(port)))
        try:
            while (data := sock.recv(1 << 16))[1:21] != msg_id:
                pass  # the node's own requests to us, a contact now
            return umsgpack.unpackb(data[21:])["subs"]
        except (TimeoutError, KeyError, TypeError) as exc:
            return repr(exc)


# --- the target and its health -----------------------------------------------------------------


@dataclass
class Target:
    swarm: LocalSwarm
    state: list[torch.Tensor]
    baseline_rss: int = 0
    baseline_fds: int = 0
    peak_rss: int = 0
    cases: int = 0
    checks: int = 0
    log_pos: dict[str, int] = field(default_factory=dict)
    samples: list[tuple[str, int]] = field(default_factory=list)
    slowest_session_end: float = 0.0
    stats: collections.Counter[str] = field(default_factory=collections.Counter)
    before_check: Callable[[], None] | None = None
    state_version: int = 0

    @property
    def daemon(self) -> DaemonProcess:
        return self.swarm.daemons[0]

    def rss(self) -> int:
        with open(f"/proc/{self.daemon.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS line")

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.daemon.proc.pid}/fd"))

    def assert_alive(self) -> None:
        for d in self.swarm.daemons:
            assert d.alive(), f"daemon {d.name} died (code {d.proc.returncode}):\n{d.log_tail(60)}"

    def assert_rss(self) -> None:
        rss = self.rss()
        self.peak_rss = max(self.peak_rss, rss)
        assert rss <= self.baseline_rss + RSS_HEADROOM, (
            f"daemon 0 RSS {rss >> 20} MiB exceeds {self.baseline_rss >> 20} MiB at start "
            f"+ {RSS_HEADROOM >> 20} MiB after {self.cases} fuzz cases")

    def after_case(self) -> None:
        self.cases += 1
        assert self.daemon.alive(), (f"daemon 0 died on this case (code "
                                     f"{self.daemon.proc.returncode}):\n{self.daemon.log_tail(60)}")
        if self.cases % 50 == 0:
            self.assert_rss()
        if self.cases % CHECK_EVERY == 0:
            self.check(f"after {self.cases} cases")

    def check_logs(self) -> None:
        for d in self.swarm.daemons:
            with open(d.log_path, errors="replace") as f:
                f.seek(self.log_pos.get(d.name, 0))
                text = f.read()
                self.log_pos[d.name] = f.tell()
            bad = bad_log_entries(text)
            assert not bad, f"daemon {d.name} logged an error:\n{bad[0]}"

    def dht_view(self, key: str) -> str:
        """What each daemon's DHT node holds under a key, and how many contacts it has."""
        out = []
        for d in self.swarm.daemons:
            with moshpit.Client(d.socket) as c:
                contacts = c.status()["status"]["dht_peers"]
            out.append(f"{d.name} ({d.info['peer_id'][:8]}, {contacts} contacts): "
                       f"{find_subs(d.dht, key)!r}")
        return "\n".join(out)

    def check(self, label: str) -> None:
        """The daemon is healthy and serves well-formed traffic from trainers and peers."""
        if self.before_check is not None:
            self.before_check()
        self.checks += 1
        self.assert_alive()
        self.samples.append((label, self.rss()))
        self.assert_rss()
        fds = self.fds()
        assert fds <= self.baseline_fds + FD_HEADROOM, (
            f"daemon 0 holds {fds} descriptors, {self.baseline_fds} at start")
        self.check_logs()
        with moshpit.Client(self.daemon.socket) as c:
            status = c.status()["status"]
            assert status["peer_id"] == self.daemon.info["peer_id"]
            assert status["dht_peers"] >= 1, status
        with grpc.insecure_channel(self.daemon.info["grpc"]) as ch:
            health = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="moshpit.Averager"), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        # an averaging round of daemons 0 and 1: DHT declarations, Join, the data plane
        key = check_key(self.checks)
        base = torch.arange(CHECK_ELEMS, dtype=torch.float32)
        inputs = [base * 2, base * 4]
        clients = [moshpit.Client(s) for s in self.swarm.sockets[:2]]

        def average(i: int) -> Callable[[], list[torch.Tensor]]:
            return lambda: clients[i].average([inputs[i]], key=key, timeout=30, group_size=2)

        try:
            results = run_parallel([average(0), average(1)])
        finally:
            for c in clients:
                c.close()
        for r in results:
            assert not isinstance(r, Exception), (
                f"averaging after fuzzing ({label}): {r!r}\n{self.dht_view(key)}")
            assert torch.equal(r[0], base * 3), f"averaging after fuzzing ({label}): wrong mean"
        # daemon 1 downloads daemon 0's state: DHT donor records and gRPC DownloadState. The
        # donor record lives DONOR_TTL (120 s): republish, as a trainer does after its rounds
        with moshpit.Client(self.daemon.socket) as c:
            c.publish_state(STATE_KEY, self.state, meta={"step": 7}, version=self.state_version)
        with moshpit.Client(self.swarm.sockets[1]) as c:
            tensors, meta = c.download_state(STATE_KEY, timeout=20)
        assert meta == {"step": 7}
        assert all(torch.equal(a, b) for a, b in zip(tensors, self.state, strict=True))
        self.check_logs()


def live_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """Body of each fuzz module's module-scoped `target` fixture: daemon 0 of a fresh swarm,
    warmed up with one check; a summary is printed at teardown."""
    # The fuzzer sends hundreds of requests a second down one connection, as a flooder would:
    # at the default grpc_receive_rate the gate would hold most of them back (a bound tested
    # on its own), and the cases would test the pacing instead of the parsing.
    swarm = LocalSwarm(3, workdir=tmp_path_factory.mktemp("fuzz"),
                       log_level=os.environ.get("MOSHPIT_FUZZ_LOG_LEVEL", "INFO"),
                       extra_args=["--grpc-receive-rate", str(64 << 20),
                                   "--grpc-receive-burst", str(64 << 20)])
    swarm.start()
    try:
        # 3 chunks of DownloadState (1 MiB each), so offsets and lengths matter
        state = [torch.arange(600_000, dtype=torch.float32), torch.full((10,), 0.5)]
        t = Target(swarm, state)
        with moshpit.Client(swarm.sockets[0]) as c:
            t.state_version = c.publish_state(STATE_KEY, state, meta={"step": 7})
        t.baseline_rss = 1 << 62  # no bound before the warm-up round sets it
        t.check("warm-up")
        t.baseline_rss = t.peak_rss = t.rss()
        t.baseline_fds = t.fds()
        yield t
        print(f"\nfuzz: daemon 0 RSS {t.baseline_rss / 2**20:.1f} MiB before fuzzing, "
              f"peak {t.peak_rss / 2**20:.1f} MiB (bound +{RSS_HEADROOM >> 20} MiB); "
              f"{t.cases} cases; slowest IPC session end {t.slowest_session_end * 1e3:.1f} ms")
        for label, rss in t.samples:
            print(f"fuzz:   {label}: {rss / 2**20:.1f} MiB")
        print("fuzz: outcomes " + ", ".join(f"{k} {v}" for k, v in sorted(t.stats.items())))
    finally:
        swarm.stop()
