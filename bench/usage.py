"""What a stretch of a benchmark cost: wall time, CPU and DHT datagrams.

DHT traffic is read from the daemons' own `moshpitd_dht_rpcs` counters, not from the machine's
UDP counters: those count every process in the network namespace, other swarms included.
"""

from __future__ import annotations

import os
import re
import time
import urllib.request
from collections.abc import Sequence

from bench.procs import cpu_seconds

_RPCS = re.compile(r"^moshpitd_dht_rpcs_total\{([^}]*)\} (\S+)$", re.MULTILINE)


def machine_cpu_seconds() -> float:
    """CPU seconds every process on the machine used so far (/proc/stat, all but idle)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait


def dht_datagrams_sent(metrics_endpoint: str) -> int:
    """DHT datagrams one daemon sent so far: its requests (answered or not) and its replies."""
    with urllib.request.urlopen(f"http://{metrics_endpoint}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    total = 0.0
    for labels, value in _RPCS.findall(text):
        # a request received ok got a reply
        if 'direction="sent"' in labels or 'result="ok"' in labels:
            total += float(value)
    return int(total)


def swarm_datagrams(endpoints: Sequence[str]) -> int:
    return sum(dht_datagrams_sent(e) for e in endpoints)


class Usage:
    """Wall time, daemon CPU, whole-machine CPU and the daemons' DHT datagrams over one stretch
    of time: daemons using about all the cores means the machine, not the protocol, sets the
    pace; machine CPU well above daemon CPU means someone else was using the machine."""

    def __init__(self, pids: list[int], metrics: Sequence[str] = ()) -> None:
        self.pids = pids
        self.metrics = list(metrics)
        self.start = (time.time(), cpu_seconds(pids), machine_cpu_seconds(),
                      swarm_datagrams(self.metrics))

    def stop(self, since: float | None = None, rounds: int = 1) -> dict[str, float]:
        """`rounds`: rounds each daemon ran in the stretch, for datagrams per daemon and round."""
        now = (time.time(), cpu_seconds(self.pids), machine_cpu_seconds(),
               swarm_datagrams(self.metrics))
        wall = now[0] - (self.start[0] if since is None else since)
        out = {"wall_s": wall, "daemon_cpu_s": now[1] - self.start[1],
               "daemon_cores": (now[1] - self.start[1]) / wall if wall > 0 else 0.0,
               "machine_cores": (now[2] - self.start[2]) / wall if wall > 0 else 0.0}
        if self.metrics:
            out["dht_datagrams"] = now[3] - self.start[3]
            out["dht_datagrams_per_daemon_round"] = (now[3] - self.start[3]) / (
                len(self.metrics) * max(rounds, 1))
        return out
