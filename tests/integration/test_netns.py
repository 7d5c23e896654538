"""Four daemons on an emulated network: one Linux network namespace per host on a bridge,
each host's link capped at 100 Mbit/s (`tc tbf`, both directions), losing 1% of the packets it
receives (nftables `numgen random mod 100 < 1 drop`) and ~50 ms of added round-trip latency.

Latency mechanism: this kernel has no `netem` (nor `fq`, `nft queue`), so an nftables
`tproxy` rule in every host hands all TCP connections and UDP datagrams arriving on its link to
a small userspace delayer in that namespace (tests/netns/delayer.py). TCP (gRPC matchmaking, the
tensor data plane): the delayer terminates the connection and forwards each direction's bytes
25 ms after reading them. UDP (the Kademlia DHT): it re-sends each datagram 25 ms later from a
transparent socket bound to the original source address, so daemons still see their peers'
real addresses. Every request/response, TCP or UDP, thus takes about 50 ms more (measured
below). TCP's own acknowledgements are not delayed (the kernel acks before the delayer reads),
so congestion control sees the bare link, unlike with netem.

Needs root, `ip`, `tc` and `nft`; skips with the reason otherwise. Trainers run in this
process: the daemons' IPC sockets are files, reachable from the root namespace.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

import moshpit
from moshpitd.launcher import DaemonProcess, wait_ready
from tests.integration.helpers import run_parallel
from tests.netns import NetnsError, Topology, missing_prerequisites

HOSTS = 4
RATE_BYTES = 100e6 / 8  # the tbf cap, bytes/s
ONE_WAY_DELAY = 0.025  # seconds added per direction: ~50 ms per round trip

pytestmark = pytest.mark.timeout(240)


@dataclass
class Net:
    topo: Topology
    daemons: list[DaemonProcess]
    sockets: list[str]

    def logs(self) -> str:
        out = []
        for d in self.daemons:
            out.append(f"--- {d.name} ({d.info.get('grpc', '?')}) ---\n{d.log_tail(40)}")
        for h in self.topo.hosts:
            path = self.topo.workdir / f"delayer-h{h.index}.log"
            text = path.read_text(errors="replace").strip() if path.exists() else ""
            if text:
                out.append(f"--- delayer h{h.index} ---\n{text[-3000:]}")
        return "\n".join(out)


@contextlib.contextmanager
def explained(net: Net) -> Iterator[None]:
    """On failure, show the daemons' and delayers' logs (pytest prints captured output)."""
    try:
        yield
    except BaseException:
        print(net.logs())
        raise


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    reason = missing_prerequisites()
    if reason:
        pytest.skip(reason)
    topo = Topology(HOSTS, tmp_path_factory.mktemp("netns"), rate="100mbit", loss_pct=1,
                    delay=ONE_WAY_DELAY)
    try:
        try:
            topo.build()
        except NetnsError as exc:  # root with the tools: a failure to build is a failure
            pytest.fail(f"cannot build the emulated network: {exc}")
        first = topo.start_daemon(topo.hosts[0])
        rest = [topo.start_daemon(h, bootstrap=[topo.hosts[0]], wait=False)
                for h in topo.hosts[1:]]
        for d in rest:
            wait_ready(d, 30)
        daemons = [first, *rest]
        yield Net(topo, daemons, [d.socket for d in daemons])
    finally:
        topo.close()


def inputs(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def check_result(result: torch.Tensor, info: moshpit.RoundInfo, own: int,
                 by_peer: dict[str, int], contributions: dict[int, torch.Tensor],
                 weights: dict[int, float]) -> set[int]:
    """Every element is the weighted mean of the contributions the round says arrived for it
    (or this peer's own value where it says none); returns the peers seen in some mean."""
    got = result.numpy().astype(np.float64)
    covered = 0
    seen: set[int] = set()
    for start, stop, mask in info.spans:
        covered += stop - start
        if mask == 0:
            np.testing.assert_array_equal(result[start:stop].numpy(),
                                          contributions[own][start:stop].numpy())
            continue
        peers = [by_peer[info.members[b]] for b in range(len(info.members)) if mask >> b & 1]
        seen.update(peers)
        num = sum(weights[p] * contributions[p][start:stop].double().numpy() for p in peers)
        want = num / sum(weights[p] for p in peers)
        np.testing.assert_allclose(got[start:stop], want, rtol=1e-5, atol=1e-6)
    assert covered == result.numel()
    return seen


def test_rounds_complete_over_capped_lossy_slow_links(net: Net) -> None:
    """4 peers average a 2M-float32 vector (8 MB; each peer sends 12 MB per round, about
    1 s at 100 Mbit/s) several times: every round assembles the whole group, no peer sends
    faster than its link allows, and every round is all four's exact mean at every peer.

    That is what the deadlines guarantee on this network: the round's budget is 2 s (the
    floor; the rate the daemons learn keeps it there), and past that deadline a sender is cut
    only if it stays silent for a whole stall window (1 s), or is still sending at the hard
    stop (4 s). A transfer takes about 1.2-2 s here, and 1% loss stalls a TCP stream for one
    or two retransmission timeouts (200-600 ms): silence for a second would take a segment
    lost three times in a row (or a lost SYN twice), about one in 10^6 losses."""
    n, rounds = 2_000_000, 4
    topo = net.topo
    with explained(net):
        rtt = [topo.ping(topo.hosts[0], topo.hosts[1]), topo.ping(topo.hosts[2], topo.hosts[3])]
        print(f"\nround trips through the delayer (median ms): {rtt}")
        for probe in rtt:
            assert 2 * ONE_WAY_DELAY * 1000 - 2 <= probe["tcp_rtt_ms"] < 150, rtt
            assert 2 * ONE_WAY_DELAY * 1000 - 2 <= probe["udp_rtt_ms"] < 150, rtt

        clients = [moshpit.Client(s) for s in net.sockets]
        by_peer = {c.peer_id: i for i, c in enumerate(clients)}
        weights = {i: 1.0 + i for i in range(HOSTS)}
        dropped_before = sum(topo.dropped(h) for h in topo.hosts)
        timings = []
        exact_rounds = 0

        def average(i: int, x: torch.Tensor, key: str) -> list[torch.Tensor]:
            return clients[i].average([x], key=key, weight=weights[i], timeout=60,
                                      group_size=HOSTS, min_group_size=HOSTS)

        for r in range(rounds):
            xs = {i: inputs(1000 * r + i, n) for i in range(HOSTS)}
            start = time.monotonic()
            results = run_parallel([functools.partial(average, i, xs[i], f"lossy-{r}")
                                    for i in range(HOSTS)], timeout=120)
            wall = time.monotonic() - start
            infos = []
            for i, res in enumerate(results):
                assert not isinstance(res, Exception), (r, i, res)
                info = clients[i].last_round
                assert info is not None and info.group_size == HOSTS, (r, i, info)
                check_result(res[0], info, i, by_peer, xs, weights)
                moving = info.seconds - info.matchmaking_seconds
                # tbf's 64 KiB bucket aside, nobody beats the cap
                assert info.bytes_sent / moving < RATE_BYTES * 1.1, (r, i, info)
                infos.append(info)
            exact_rounds += all(x.fully_averaged for x in infos)
            timings.append({
                "round": r, "wall_s": round(wall, 2),
                "matchmaking_s": [round(x.matchmaking_seconds, 2) for x in infos],
                "allreduce_s": [round(x.seconds - x.matchmaking_seconds, 2) for x in infos],
                "sent_MB": [round(x.bytes_sent / 1e6, 1) for x in infos],
                "not_all_four": [sum(b - a for a, b, m in x.spans if m != (1 << HOSTS) - 1)
                                 for x in infos]})
        dropped = sum(topo.dropped(h) for h in topo.hosts) - dropped_before
        for t in timings:
            print(t)
        print(f"packets dropped by the 1% loss rules during the rounds: {dropped}; rounds "
              f"exact at all four peers: {exact_rounds} of {rounds}")
        assert dropped > 0, "the loss rules dropped nothing"
        assert exact_rounds == rounds, timings
        for c in clients:
            c.close()


@dataclass
class Attempt:
    peer: int
    start: float
    end: float
    group_size: int = 0  # 0: the call raised
    error: str = ""
    members: set[int] = field(default_factory=set)


def test_host_cut_off_for_10s_rejoins(net: Net) -> None:
    """Every trainer averages in a loop under one key. Host 4's link goes down for 10 s: the
    other three keep completing rounds among themselves; once it is back, its daemon finds
    its DHT contacts again and it averages with the others within 30 s."""
    n, outage, rejoin_bound = 500_000, 10.0, 30.0
    topo = net.topo
    victim = HOSTS - 1
    xs = {i: inputs(5000 + i, n) for i in range(HOSTS)}
    weights = {i: 1.0 + i for i in range(HOSTS)}
    clients = [moshpit.Client(s) for s in net.sockets]
    watch = moshpit.Client(net.sockets[victim])  # status while its trainer waits in a round
    by_peer = {c.peer_id: i for i, c in enumerate(clients)}
    attempts: list[Attempt] = []
    failures: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()
    t0 = time.monotonic()

    def now() -> float:
        return time.monotonic() - t0

    def trainer(i: int) -> None:
        while not stop.is_set():
            start = now()
            try:
                out = clients[i].average([xs[i]], key="cut", weight=weights[i], timeout=8,
                                         group_size=HOSTS, min_group_size=2)
            except moshpit.MoshpitError as exc:
                with lock:
                    attempts.append(Attempt(i, start, now(), error=repr(exc)[:200]))
                time.sleep(0.2)
                continue
            info = clients[i].last_round
            assert info is not None
            try:
                members = check_result(out[0], info, i, by_peer, xs, weights)
            except AssertionError as exc:
                with lock:
                    failures.append(f"peer {i} at {start:.1f} s: {exc}")
                members = set()
            with lock:
                attempts.append(Attempt(i, start, now(), info.group_size, members=members))

    def ok() -> list[Attempt]:
        with lock:
            return [a for a in attempts if a.group_size > 0]

    def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return now()
            time.sleep(0.1)
        raise AssertionError(f"{what}: not within {timeout} s")

    def timeline() -> None:
        with lock:
            for a in sorted(attempts, key=lambda a: a.start):
                print(f"  peer {a.peer + 1}: {a.start:6.2f}-{a.end:6.2f} s "
                      + (f"group {a.group_size}, means over {sorted(m + 1 for m in a.members)}"
                         if a.group_size else a.error))

    threads = [threading.Thread(target=trainer, args=(i,), daemon=True) for i in range(HOSTS)]
    for th in threads:
        th.start()
    contacts: list[int] = []
    with explained(net):
        try:
            wait_for(lambda: all(any(a.peer == i and a.group_size == HOSTS for a in ok())
                                 for i in range(HOSTS)), 30, "a first round of all four")
            t_cut = now()
            topo.link(topo.hosts[victim], up=False)
            while now() < t_cut + outage:
                contacts.append(watch.status()["status"]["dht_peers"])
                time.sleep(0.5)
            t_up = now()
            topo.link(topo.hosts[victim], up=True)
            print(f"\ncut at {t_cut:.1f} s, restored at {t_up:.1f} s; host 4's DHT contacts "
                  f"during the outage, every 0.5 s: {contacts}")
            t_contacts = wait_for(lambda: watch.status()["status"]["dht_peers"] > 0,
                                  rejoin_bound, "host 4's DHT contacts back")
            t_back = wait_for(lambda: any(a.peer == victim and a.start >= t_up
                                          and a.group_size == HOSTS for a in ok()),
                              rejoin_bound - (now() - t_up), "host 4 averaging with all again")
            print(f"host 4's DHT contacts back {t_contacts - t_up:.1f} s after the link came "
                  f"back; it averaged with all four again after {t_back - t_up:.1f} s")
        finally:
            stop.set()
            for th in threads:
                th.join(30)
            timeline()
        assert not failures, failures
        during = [a for a in attempts if t_cut + 1 < a.start and a.end < t_up]
        three = set(range(HOSTS - 1))
        for i in range(HOSTS - 1):
            mine = [a for a in during if a.peer == i and a.group_size > 0]
            assert mine, f"peer {i + 1} completed no round while host 4 was cut off"
            # a member whose part came past the deadline (a loaded machine) leaves a mean over
            # fewer, which check_result verified, down to none at all: every part kept its local
            # value (members empty; CI saw it once at load 8); host 4 is in none of them
            assert all(a.group_size == HOSTS - 1 and a.members <= three
                       and (not a.members or i in a.members) for a in mine), mine
        assert any(a.members == three for a in during), "no round over all three survivors"
        assert not [a for a in during if a.peer == victim and a.group_size > 1], \
            "host 4 averaged with others while cut off"
        # its first round back is with others (a survivor still finishing its last round may
        # miss it: a group assembles once everyone declared is in); one with all four came
        # within rejoin_bound (t_back above)
        victim_back = min((a for a in ok() if a.peer == victim and a.start >= t_up),
                          key=lambda a: a.end)
        assert victim in victim_back.members and len(victim_back.members) > 1, victim_back
    for c in [*clients, watch]:
        c.close()
