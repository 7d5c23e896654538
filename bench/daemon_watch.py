"""What a benchmark reads of its daemons while they run: /metrics (loop lag, refusals), peak
memory from /proc, and the loop stalls they logged.

A daemon's numbers are read again on every `observe`; the latest reading of each daemon, by
name, stands for it (a daemon killed since keeps the reading before its death), and a phase
adds them up over every daemon that ran in it."""

from __future__ import annotations

import math
import re
import urllib.request
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from moshpitd.launcher import DaemonProcess

LAG = "moshpitd_event_loop_lag_seconds"
# what each daemon counts of what it refused (prefixes of sample names)
REFUSALS = ("moshpitd_auth_rejected_total", "moshpitd_joins_refused_total",
            "moshpitd_data_streams_refused_total", "moshpitd_dht_records_refused_total",
            "moshpitd_grpc_refused_total",
            'moshpitd_dht_rpcs_total{direction="received",rpc="any",result="dropped_by_kernel"}')
STALL = re.compile(r"event loop was blocked for ([0-9.]+) s")  # moshpitd/node.py, past 0.25 s
SAMPLE = re.compile(r"^([^#\s]\S*) (\S+)$", re.MULTILINE)
BUCKET = re.compile(LAG + r'_bucket\{le="([^"]+)"\}')


def scrape(address: str, timeout: float = 2.0) -> dict[str, float]:
    """A daemon's /metrics, sample name (with labels) -> value."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as r:
        text = r.read().decode()
    return {m[1]: float(m[2]) for m in SAMPLE.finditer(text)}


def peak_mib(pid: int) -> float:
    """The process's peak resident memory (VmHWM), MiB."""
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def quantile(buckets: dict[float, float], q: float) -> float:
    """Estimated as Prometheus's histogram_quantile does: linear within the bucket the rank
    falls in; the highest finite bound if it falls past it. `buckets`: le -> cumulative."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total == 0:
        return 0.0
    rank, lower, below = q * total, 0.0, 0.0
    for le in bounds:
        if buckets[le] >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / max(buckets[le] - below, 1e-12)
        lower, below = le, buckets[le]
    return lower


def logged_stalls(logs: Iterable[Path]) -> list[float]:
    out: list[float] = []
    for path in logs:
        out += [float(m[1]) for m in STALL.finditer(path.read_text(errors="replace"))]
    return out


@dataclass
class DaemonWatch:
    """The latest reading of every daemon it was shown."""

    samples: dict[str, dict[str, float]] = field(default_factory=dict)
    peaks: dict[str, float] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)
    failed_scrapes: int = 0

    def observe(self, daemons: Iterable[DaemonProcess]) -> None:
        for d in daemons:
            if not d.alive():
                continue
            self.logs[d.name] = d.log_path
            try:
                self.peaks[d.name] = peak_mib(d.proc.pid)
                self.samples[d.name] = scrape(d.info["metrics"])
            except (OSError, StopIteration):  # killed meanwhile, or too busy to answer
                self.failed_scrapes += 1

    def lag_buckets(self) -> dict[float, float]:
        total: dict[float, float] = {}
        for sample in self.samples.values():
            for name, value in sample.items():
                if m := BUCKET.fullmatch(name):
                    total[float(m[1])] = total.get(float(m[1]), 0.0) + value
        return total

    def refusals(self) -> dict[str, int]:
        total: Counter[str] = Counter()
        for sample in self.samples.values():
            for name, value in sample.items():
                if name.startswith(REFUSALS) and value:
                    total[name.removesuffix("_total").removeprefix("moshpitd_")] += int(value)
        return dict(sorted(total.items()))

    def report(self) -> dict[str, object]:
        stalls = logged_stalls(p for p in self.logs.values() if p.exists())
        buckets = self.lag_buckets()
        count = buckets.get(math.inf, 0.0)
        top = min((le for le, n in buckets.items() if n >= count), default=0.0) if count else 0.0
        peaks = sorted(self.peaks.values())
        return {
            "daemons": len(self.peaks),
            "peak_mib_max": round(peaks[-1], 1) if peaks else 0.0,
            "peak_mib_median": round(peaks[len(peaks) // 2], 1) if peaks else 0.0,
            "loop_lag_samples": int(count),
            "stall_p99_s": round(quantile(buckets, 0.99), 4),
            # the longest logged (past 0.25 s), else the bound of the highest bucket in use
            "stall_max_s": round(max(stalls), 3) if stalls else top,
            "stalls_logged": len(stalls),
            "refusals": self.refusals(),
            "failed_scrapes": self.failed_scrapes,
        }
