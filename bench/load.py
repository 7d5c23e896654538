"""`python -m bench.load`: round time while trainers saturate the machine's cores.

Four daemons on loopback average --elems float32 each (one trainer thread per daemon, all in
this process), --rounds times in each of three phases, in this order:

* idle: nothing else runs (beyond whatever else the machine runs: see the load average);
* busy: --busy processes spin in pure Python (`while True: pass`), as trainers keep every core
  busy;
* busy, daemons at nice -5: the same, with the daemons reniced as deploy/moshpitd.service
  does (Nice=-5; the unit's CPUWeight=1000 does the same for its cgroup).

Reported per phase: the median and max of the slowest peer's call seconds, and the daemon's
own round seconds (matchmaking plus all-reduce), with ratios to the idle phase. Renicing
needs root; without it the third phase is skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

import moshpit
from bench.cli import exit_on_sigterm, positive
from bench.procs import cpu_seconds
from moshpitd.launcher import LocalSwarm


@contextlib.contextmanager
def spinning(count: int) -> Iterator[list[int]]:
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                              stdin=subprocess.DEVNULL) for _ in range(count)]
    try:
        pids = [p.pid for p in procs]
        deadline = time.monotonic() + 20
        while cpu_seconds(pids) < 0.5 * count and time.monotonic() < deadline:
            time.sleep(0.05)  # started, then spinning: the interpreter's start-up is not load
        yield pids
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def phase(clients: list[moshpit.Client], name: str, rounds: int, elems: int) -> dict[str, Any]:
    calls, daemon = [], []
    for r in range(rounds + 1):  # the first round of a phase is a warm-up
        def one(i: int, r: int = r) -> tuple[float, float]:
            t0 = time.perf_counter()
            clients[i].average([torch.full((elems,), float(i))], key=f"load-{name}-{r}",
                               group_size=len(clients), timeout=60)
            info = clients[i].last_round
            assert info is not None and info.group_size == len(clients), info
            return time.perf_counter() - t0, info.seconds

        with ThreadPoolExecutor(len(clients)) as pool:
            out = list(pool.map(one, range(len(clients))))  # raises the first failure
        if r:
            calls.append(max(o[0] for o in out))
            daemon.append(max(o[1] for o in out))
        print(f"[bench.load] {name} {r or 'warm-up'}: call {max(o[0] for o in out):.3f} s",
              file=sys.stderr, flush=True)
    return {"phase": name, "call_median_s": statistics.median(calls), "call_max_s": max(calls),
            "round_median_s": statistics.median(daemon)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--elems", type=positive, default=1_000_000, help="float32 per peer")
    p.add_argument("--rounds", type=positive, default=8, help="timed rounds per phase")
    p.add_argument("--busy", type=positive, default=4, help="spinning processes")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    exit_on_sigterm()
    torch.set_num_threads(1)
    rows = []
    load_before = os.getloadavg()
    with LocalSwarm(4) as swarm:
        clients = [moshpit.Client(s) for s in swarm.sockets]
        try:
            rows.append(phase(clients, "idle", args.rounds, args.elems))
            with spinning(args.busy):
                rows.append(phase(clients, "busy", args.rounds, args.elems))
                if os.geteuid() == 0:
                    for d in swarm.daemons:
                        os.setpriority(os.PRIO_PROCESS, d.proc.pid, -5)
                    rows.append(phase(clients, "busy-nice-5", args.rounds, args.elems))
        finally:
            for c in clients:
                c.close()
    base = rows[0]["call_median_s"]
    report = {"elems": args.elems, "busy": args.busy, "cores": os.cpu_count(),
              "loadavg_before": load_before, "rows": rows}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"4 daemons, {args.elems} float32 each, {args.busy} spinning processes on "
          f"{os.cpu_count()} cores; load average before: {load_before[0]:.2f}")
    print(f"{'phase':<12} {'call med s':>10} {'call max s':>10} {'round med s':>11} "
          f"{'x idle':>7}")
    for r in rows:
        print(f"{r['phase']:<12} {r['call_median_s']:>10.3f} {r['call_max_s']:>10.3f} "
              f"{r['round_median_s']:>11.3f} {r['call_median_s'] / base:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
