"""Peers behind NAT on an emulated network (netlab, netlab/nat.py): two public hosts, one behind
a port-preserving NAT and one behind a random-port NAT, every daemon on the defaults (listen
addresses, a swarm key, a bootstrap).

Each NATed daemon finds by itself that it is private (its peers' dial-backs never reach it),
reserves a relay at a public peer, and reduces its share of every round: through the relay
at first, then, for public senders, on connections it dialed them itself (direct paths, behind
either NAT). Each result is the exact mean its masks name, and /metrics shows the bytes it
reduced. Then the
relay of one of them is killed mid-run: that peer is relayed by the other public peer within
seconds, and the next round is exact again; so is a round between the two NATed trainers
alone, the surviving public daemon only relaying.

Needs root, `ip`, `tc` and `nft` (CI runs as root); skips with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import moshpit
from moshpitd.launcher import DaemonProcess
from tests.integration.helpers import run_parallel, wait_until
from tests.netns import Host, Topology, missing_prerequisites

NATS = (None, None, "preserve", "random")
PUBLIC, PRIVATE = (0, 1), (2, 3)
ELEMS = 250_000

pytestmark = pytest.mark.timeout(180)


def reachability(daemon: DaemonProcess, sock: str) -> dict[str, Any]:
    with contextlib.closing(moshpit.Client(sock)) as client:
        status = client.status()["status"]
    assert isinstance(status, dict)
    return status["reachability"]  # type: ignore[no-any-return]


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[tuple[Topology, list[DaemonProcess]]]:
    reason = missing_prerequisites()
    if reason:
        pytest.skip(reason)
    key = tmp_path / "swarm.key"
    key.write_bytes(os.urandom(32).hex().encode() + b"\n")
    key.chmod(0o600)
    args = ["--swarm-key-file", str(key), "--bandwidth", "50"]
    with Topology(len(NATS), tmp_path / "net", rate="50mbit", loss_pct=0, delay=0.005,
                  nat=NATS) as topo:
        first = topo.start_daemon(topo.hosts[0], extra_args=args)
        daemons = [first, *(topo.start_daemon(h, bootstrap=[topo.hosts[0]], extra_args=args)
                            for h in topo.hosts[1:])]
        try:
            yield topo, daemons
        except BaseException:
            for d in daemons:
                print(f"--- {d.name} ---\n{d.log_tail(60)}")
            raise


def socket_of(topo: Topology, daemon: DaemonProcess) -> str:
    return str(daemon.info["ipc"])


def metrics_in(topo: Topology, host: Host, daemon: DaemonProcess) -> dict[str, float]:
    """/metrics of a daemon in a namespace (it listens on that namespace's loopback)."""
    code = ("import sys, urllib.request; "
            "sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())")
    text = subprocess.run(host.exec_args(sys.executable, "-c", code,
                                         f"http://{daemon.info['metrics']}/metrics"),
                          capture_output=True, text=True, timeout=30, check=True).stdout
    return {m[1]: float(m[2]) for m in re.finditer(r"^([^#\s]\S*) (\S+)$", text, re.MULTILINE)}


def exact_round(clients: list[moshpit.Client], key: str, seed: int) -> None:
    """A round of all `clients`: every span of every result is the exact mean of the inputs its
    mask names (its own where the mask is 0), and most of the vector was averaged by all (a
    peer whose relay failed it would leave its whole share out of everyone's result)."""
    n = len(clients)
    xs = [torch.randn(ELEMS, generator=torch.Generator().manual_seed(seed + i))
          for i in range(n)]
    outs = run_parallel([lambda i=i: clients[i].average(
        [xs[i]], key=key, timeout=60, group_size=n, min_group_size=n) for i in range(n)])
    ids = {c.peer_id: i for i, c in enumerate(clients)}
    full = 0
    for i, client in enumerate(clients):
        info = client.last_round
        assert isinstance(outs[i], list) and info is not None, outs[i]
        got = outs[i][0].numpy()
        members = [ids[m] for m in info.members]
        assert sorted(members) == list(range(n))
        for start, stop, mask in info.spans:
            named = [members[b] for b in range(n) if mask >> b & 1] or [i]
            want = np.mean([xs[m].numpy()[start:stop] for m in named], axis=0)
            np.testing.assert_allclose(got[start:stop], want, rtol=1e-5, atol=1e-6)
            full += (stop - start) * (len(named) == n)
    assert full > 0.6 * ELEMS * n, f"only {full} of {ELEMS * n} elements averaged by all"


def test_peers_behind_either_nat_reduce_through_relays(
        lab: tuple[Topology, list[DaemonProcess]]) -> None:
    topo, daemons = lab
    socks = [socket_of(topo, d) for d in daemons]
    for i in PUBLIC:
        wait_until(lambda i=i: reachability(daemons[i], socks[i])["state"] == "public", 30,
                   f"host {i + 1} found public")
    relays: dict[int, str] = {}
    for i in PRIVATE:
        reach = wait_until(lambda i=i: (r := reachability(daemons[i], socks[i]))["relayed_by"]
                           and r, 30, f"host {i + 1} relayed")
        assert reach["state"] == "private" and "none reached" in reach["why"]
        assert reach["observed"] == topo.hosts[i].public_ip  # its router's address
        relays[i] = reach["relayed_by"]["peer_id"]
    clients = [moshpit.Client(s) for s in socks]

    def relayed() -> float:
        return sum(metrics_in(topo, topo.hosts[i], daemons[i])["moshpitd_relay_bytes_total"]
                   for i in PUBLIC)
    before = relayed()
    exact_round(clients, "nat1", 100)
    for i in PRIVATE:
        assert metrics_in(topo, topo.hosts[i], daemons[i])["moshpitd_reduced_bytes_total"] > 0
    # each private owner offered the others a direct connection as that round started: the
    # public members' next streams to it run on those (or on the sessions they left), not
    # through the relay, behind either kind of NAT
    first = relayed() - before
    exact_round(clients, "nat1b", 150)
    for i in PUBLIC:
        m = metrics_in(topo, topo.hosts[i], daemons[i])
        assert m['moshpitd_data_streams_total{how="reversed",side="opened"}'] >= 1, m
    # only the two private peers' streams to each other still go through relays: a third of
    # what a round relays without direct paths (3 senders to each private owner, parts and
    # results; the first round may already have used some offers)
    second = relayed() - before - first
    without = len(PRIVATE) * (len(NATS) - 1) * 2 * ELEMS * 4 / len(NATS)
    assert second < 0.5 * without, (first, second, without)
    # kill the relay of the random-port peer (if it is the bootstrap, the other one goes)
    by_id = {d.info["peer_id"]: n for n, d in enumerate(daemons)}
    victim = by_id[relays[PRIVATE[1]]]
    daemons[victim].proc.send_signal(signal.SIGKILL)
    daemons[victim].proc.wait(10)
    survivor = PUBLIC[1 - PUBLIC.index(victim)]
    for i in PRIVATE:
        wait_until(lambda i=i: (r := reachability(daemons[i], socks[i])["relayed_by"])
                   and r["peer_id"] == daemons[survivor].info["peer_id"], 20,
                   f"host {i + 1} relayed by the surviving public peer")
    left = [clients[n] for n in range(len(daemons)) if n != victim]
    exact_round(left, "nat2", 200)
    # every trainer behind NAT, the one public daemon only relaying: they still average, and
    # each reduces its half through the relay
    before = [metrics_in(topo, topo.hosts[i], daemons[i])["moshpitd_reduced_bytes_total"]
              for i in PRIVATE]
    exact_round([clients[i] for i in PRIVATE], "nat3", 300)
    for i, was in zip(PRIVATE, before, strict=True):
        assert metrics_in(topo, topo.hosts[i], daemons[i])["moshpitd_reduced_bytes_total"] > was
