"""Interface byte counters and cgroup CPU of every emulated host, sampled about once a second
while a system runs (bench/swarm/metrics.py reads them from run.json)."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from netlab import Topology


@dataclass
class Sampler:
    """Interface byte counters and cgroup CPU of every host, about once a second."""

    topo: Topology
    every: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample(self) -> None:
        row: dict[str, Any] = {"t": time.time(), "tx": [], "rx": [], "cpu": [], "throttled": []}
        for host in self.topo.hosts:
            tx, rx = self.topo.counters(host)
            row["tx"].append(tx)
            row["rx"].append(rx)
            cg = host.cgroup
            row["cpu"].append(cg.cpu_seconds() if cg else 0.0)
            row["throttled"].append(cg.throttled_seconds() if cg else 0.0)
        row["delayer_cpu"] = [self.topo.delayer_cpu_seconds(h) for h in self.topo.hosts]
        row["loadavg"] = os.getloadavg()[0]  # the whole machine: other work shows here
        self.rows.append(row)

    def start(self) -> None:
        self.sample()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="sampler")
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()
