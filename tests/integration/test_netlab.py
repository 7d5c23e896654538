"""netlab on real namespaces: per-host delays as documented, counters that see every byte,
a rate change that takes effect while connected, CPU cgroups that hold a host's whole process
tree and kill it. Needs root, ip/tc/nft and a writable CPU cgroup; skips with the reason."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from netlab import LinkSpec, Topology, missing_prerequisites, run

pytestmark = pytest.mark.timeout(120)

SEND = """
import socket, sys, time
sock = socket.create_connection((sys.argv[1], 9100))
chunk = b"x" * (1 << 16)
end = time.monotonic() + float(sys.argv[2])
sent = 0
while time.monotonic() < end:
    sock.sendall(chunk)
    sent += len(chunk)
sock.close()
print(sent)
"""
SINK = """
import socket, sys
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], 9100))
srv.listen()
open(sys.argv[2], "w").close()
while True:
    conn, _ = srv.accept()
    while conn.recv(1 << 20):
        pass
"""


@pytest.fixture(scope="module")
def topo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    reason = missing_prerequisites(need_cgroup=True)
    if reason:
        pytest.skip(reason)
    links = [LinkSpec(50.0, 0.010, 0.0), LinkSpec(20.0, 0.040, 0.0)]
    with Topology(2, tmp_path_factory.mktemp("netlab"), links=links, cpu_cores=0.5) as t:
        yield t


def _wait_file(path: Path, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 20
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "sink did not start"
        time.sleep(0.02)


def test_round_trips_follow_each_hosts_delay(topo: Topology) -> None:
    a, b = topo.hosts
    to_b = topo.ping(a, b)
    # TCP to b: b's 40 ms in each direction; UDP a -> b -> a: 40 ms + 10 ms
    assert 75 <= to_b["tcp_rtt_ms"] <= 140, to_b
    assert 45 <= to_b["udp_rtt_ms"] <= 110, to_b
    to_a = topo.ping(b, a)
    assert 15 <= to_a["tcp_rtt_ms"] <= 70, to_a


def test_counters_rate_change_cgroup_and_kill(topo: Topology, tmp_path: Path) -> None:
    a, b = topo.hosts
    ready = tmp_path / "sink.ready"
    sink = topo.spawn(b, [sys.executable, "-c", SINK, b.ip, str(ready)],
                      stdout=subprocess.DEVNULL)
    _wait_file(ready, sink)
    assert b.cgroup is not None and sink.pid in b.cgroup.pids()  # joined before exec

    def rate_into_b(seconds: float = 3.0) -> tuple[float, int, int]:
        """Mbit/s b receives, from its counter over the last second of a transfer from a
        (the first second fills socket buffers and the bucket); a's tx and b's rx deltas."""
        tx0, _ = topo.counters(a)
        _, rx0 = topo.counters(b)
        sender = subprocess.Popen(a.exec_args(sys.executable, "-c", SEND, b.ip, str(seconds)),
                                  stdout=subprocess.PIPE, text=True)
        time.sleep(seconds - 1.2)
        _, mid0 = topo.counters(b)
        t0 = time.monotonic()
        time.sleep(1.0)
        _, mid1 = topo.counters(b)
        mbit = (mid1 - mid0) * 8 / 1e6 / (time.monotonic() - t0)
        out, _ = sender.communicate(timeout=30)
        sent = int(out)
        deadline = time.monotonic() + 20  # what is still queued drains at the link's rate
        while topo.counters(b)[1] - rx0 < sent and time.monotonic() < deadline:
            time.sleep(0.05)
        tx1, _ = topo.counters(a)
        _, rx1 = topo.counters(b)
        assert tx1 - tx0 >= sent and rx1 - rx0 >= sent  # every byte, headers on top
        return mbit, tx1 - tx0, rx1 - rx0

    fast, _, _ = rate_into_b()
    assert 12 <= fast <= 23, fast  # b's link: 20 Mbit/s
    topo.set_rate(b, 5.0)
    shown = run("tc", "-n", b.ns, "qdisc", "show", "dev", "eth0").stdout
    assert "5Mbit" in shown, shown
    slow, _, _ = rate_into_b()
    assert slow <= 6.0, slow
    topo.set_rate(b, b.link.rate_mbit)

    # a process tree in b's cgroup: the shell and its children all go with one kill
    tree = topo.spawn(b, ["sh", "-c", "sleep 300 & sleep 300 & wait"],
                      stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while len(b.cgroup.pids()) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(b.cgroup.pids()) >= 4  # sink, sh, two sleeps
    assert b.cgroup.cpu_seconds() > 0
    assert topo.kill_host(b) >= 4
    assert b.cgroup.pids() == []
    assert sink.wait(5) < 0 and tree.wait(5) < 0
    assert topo.delayer_cpu_seconds(b) > 0  # the delayer lives outside the cgroup
    assert b.delayer is not None and b.delayer.poll() is None
