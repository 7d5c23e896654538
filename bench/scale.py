"""`python -m bench.scale`: how many daemons one small machine holds in one swarm.

The issue's goal is 64 daemons at <= 100 MB RSS each. This starts a LocalSwarm of --max real
daemons on loopback and measures:

1. start-up time, then each daemon's idle RSS (and PSS, which splits shared pages fairly, so its
   sum is the swarm's real footprint) and the CPU the idle swarm burns;
2. what one trainer-side client process costs (python + torch + moshpit, one small round done);
3. exactness at scale: every peer averages a random tensor on a full M^d grid with initial_coords
   filling it and rounds=d in one call, so every peer must hold the global mean;
4. convergence without initial_coords (daemons pick the emptiest cells): one round per call, the
   MSE to the global mean relative to the start after each call.

Trainers are 64 threads of this process, each with its own moshpit.Client, not 64 processes:
one process with torch costs ~225 MB RSS, ~170 MB PSS (step 2 measures it), so 64 of them
(~10 GB, ~90 CPU-seconds of imports) would dwarf the daemons on a 2-core machine. A thread blocks
on its socket with the GIL released while its daemon works, so the threads only add the small
copies in and out of shared memory (machine CPU minus daemon CPU in the report bounds them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

import moshpit
from bench.cli import exit_on_sigterm
from bench.matchmaking import code_version
from bench.procs import BenchError, Children, child_env
from bench.scale_report import GOAL_MB, print_report
from bench.usage import Usage
from moshpitd.launcher import LaunchError, LocalSwarm
from moshpitd.matchmaking.grid import Grid, GridError

MB = 1024 * 1024


def _log(msg: str) -> None:
    print(f"[bench.scale] {msg}", file=sys.stderr, flush=True)


# --- memory ---------------------------------------------------------------------------------------
def memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of a process in KiB; PSS charges each shared page to its sharers in part."""
    rss = pss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    with contextlib.suppress(OSError), open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                pss = int(line.split()[1])
    return rss, pss


def mem_available_mb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return math.nan


def memory_stats(pids: Sequence[int]) -> dict[str, Any]:
    """Per-daemon RSS spread and the swarm's totals, in MB."""
    rows = [memory_kib(pid) for pid in pids]
    rss = sorted(r / 1024 for r, _ in rows)
    return {"rss_min_mb": rss[0], "rss_median_mb": statistics.median(rss),
            "rss_max_mb": rss[-1], "rss_total_mb": sum(rss),
            "pss_total_mb": sum(p for _, p in rows) / 1024,
            "pss_median_mb": statistics.median(p / 1024 for _, p in rows),
            "over_goal": sum(r > GOAL_MB for r in rss),
            "mem_available_mb": mem_available_mb()}


# --- trainers as threads ------------------------------------------------------------------------
Step = Callable[[int, moshpit.Client], Any]


def run_peers(clients: list[moshpit.Client], step: Step, timeout: float, pids: list[int],
              metrics: Sequence[str] = (), rounds: int = 1
              ) -> tuple[list[Any], list[float], dict[str, float]]:
    """step(i, client) on one thread per client, all released together by a barrier.
    Returns each peer's result (or the exception it raised), each peer's seconds, and the
    resources used from the release to the last peer done."""
    n = len(clients)
    results: list[Any] = [None] * n
    seconds = [math.nan] * n
    barrier = threading.Barrier(n + 1)

    def body(i: int) -> None:
        barrier.wait()
        t0 = time.perf_counter()
        try:
            results[i] = step(i, clients[i])
        except Exception as exc:  # reported per peer; one failure must not hide the others
            results[i] = exc
        seconds[i] = time.perf_counter() - t0

    threads = [threading.Thread(target=body, args=(i,), daemon=True, name=f"peer-{i}")
               for i in range(n)]
    for t in threads:
        t.start()
    usage = Usage(pids, metrics)
    barrier.wait()
    deadline = time.monotonic() + timeout + 30.0
    for t in threads:
        while t.is_alive() and time.monotonic() < deadline:
            t.join(0.2)  # short joins: Ctrl-C still reaches this thread
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        raise BenchError(f"{len(stuck)} peer(s) still inside average after {timeout + 30:.0f} s:"
                         f" {stuck[:8]}")
    return results, seconds, usage.stop(rounds=rounds)


def daemon_rounds(clients: list[moshpit.Client], prefix: str, since: float) -> dict[str, Any]:
    """What the daemons recorded for the rounds under prefix finished after `since` (wall
    clock): results (ok, alone, partial, matchmaking_failed, ...) and per-round matchmaking
    seconds, which the client only reports summed over a call's rounds."""
    records = [r for c in clients for r in c.rounds()
               if str(r.get("key", "")).startswith(prefix) and r.get("finished", 0) >= since]
    mm = sorted(float(r["matchmaking_seconds"]) for r in records
                if r.get("result") not in ("matchmaking_failed", "alone"))
    return {"results": dict(Counter(str(r.get("result")) for r in records)),
            "round_mm_median_s": statistics.median(mm) if mm else None,
            "round_mm_max_s": mm[-1] if mm else None}


def errors_of(results: list[Any]) -> list[str]:
    return [f"peer {i}: {type(r).__name__}: {r}" for i, r in enumerate(results)
            if isinstance(r, Exception)]


# --- the steps ----------------------------------------------------------------------------------
def probe_client_process(swarm: LocalSwarm, elems: int, timeout: float) -> dict[str, Any]:
    """One trainer-like process (bench.matchmaking's worker: python, torch, moshpit) averages
    once with a thread of ours; its memory then is what each process-per-peer would cost."""
    with Children() as kids:
        w = kids.start("client probe", "bench.matchmaking",
                       ["--worker", "--socket", swarm.sockets[0], "--elems", str(elems)],
                       child_env())
        pid = int(w.recv(120.0)["pid"])
        with moshpit.Client(swarm.sockets[1]) as partner:
            w.send(json.dumps({"key": "scale-probe", "group_size": 2, "timeout": timeout,
                               "at": time.time()}))
            partner.average([torch.ones(elems)], key="scale-probe", group_size=2,
                            timeout=timeout)
            reply = w.recv(timeout + 30.0)
        if "error" in reply:
            raise BenchError(f"client probe: {reply['error']}")
        rss, pss = memory_kib(pid)
        w.send(json.dumps({"op": "quit"}))
    return {"rss_mb": rss / 1024, "pss_mb": pss / 1024}


def full_grid(clients: list[moshpit.Client], grid: Grid, elems: int, timeout: float,
              pids: list[int], metrics: Sequence[str] = ()) -> dict[str, Any]:
    """rounds=d on a full grid from initial_coords: every peer must end at the global mean."""
    cells = list(grid.all_cells())
    tensors = [torch.randn(elems, generator=torch.Generator().manual_seed(i))
               for i in range(len(clients))]
    mean = torch.stack(tensors).double().mean(0)

    def step(i: int, client: moshpit.Client) -> tuple[torch.Tensor, moshpit.RoundInfo | None]:
        (out,) = client.average([tensors[i]], key="scale-grid", grid=(grid.size, grid.dims),
                                rounds=grid.dims, initial_coords=cells[i], timeout=timeout)
        return out, client.last_round

    since = time.time()
    results, seconds, usage = run_peers(clients, step, timeout, pids, metrics, grid.dims)
    ok = [r for r in results if not isinstance(r, Exception)]
    full = [info for _, info in ok if info is not None
            and list(info.group_sizes) == [grid.size] * grid.dims]
    errs = [float((out.double() - mean).abs().max()) for out, _ in ok]
    infos = [info for _, info in ok if info is not None]
    return {
        "key": "scale-grid", "rounds": grid.dims, "elems": elems, **usage,
        "call_max_s": max(seconds), "call_median_s": statistics.median(seconds),
        "matchmaking_max_s": max((i.matchmaking_seconds for i in infos), default=None),
        "group_sizes": dict(Counter(str(list(i.group_sizes)) for i in infos).most_common()),
        # all peers must end in round d - 1; others skipped or repeated rounds
        "last_rounds": dict(Counter(i.round for i in infos).most_common()),
        "peers_all_rounds_full": len(full), **daemon_rounds(clients, "scale-grid/", since),
        "max_abs_error": max(errs, default=None),
        "exact": len(ok) == len(results) and max(errs, default=1.0) < 1e-5,
        "errors": errors_of(results),
    }


def random_cells(clients: list[moshpit.Client], grid: Grid, elems: int, calls: int,
                 timeout: float, pids: list[int], metrics: Sequence[str] = ()
                 ) -> dict[str, Any]:
    """No initial_coords: daemons choose cells themselves; one round per call. The MSE to the
    global mean, relative to the start, after each call shows how well they filled the grid."""
    n = len(clients)
    values = [torch.randn(elems, generator=torch.Generator().manual_seed(10_000 + i))
              for i in range(n)]
    mean = torch.stack(values).double().mean(0)

    def mse() -> float:
        return float(statistics.fmean(float(((v.double() - mean) ** 2).mean()) for v in values))

    start = mse()
    rows: list[dict[str, Any]] = []
    coords: Counter[tuple[int, ...]] = Counter()
    for call in range(1, calls + 1):
        def step(i: int, client: moshpit.Client) -> tuple[torch.Tensor,
                                                            moshpit.RoundInfo | None]:
            (out,) = client.average([values[i]], key="scale-random",
                                    grid=(grid.size, grid.dims), rounds=1, timeout=timeout)
            return out, client.last_round

        since = time.time()
        results, seconds, usage = run_peers(clients, step, timeout, pids, metrics)
        infos: list[moshpit.RoundInfo] = []
        for i, r in enumerate(results):
            if not isinstance(r, Exception):
                values[i] = r[0]
                if r[1] is not None:
                    infos.append(r[1])
        if call == 1:
            coords = Counter(i.coords for i in infos if i.coords is not None)
        rows.append({
            "call": call, "mse_ratio": mse() / start, **usage,
            "call_max_s": max(seconds), "matchmaking_max_s":
                max((i.matchmaking_seconds for i in infos), default=None),
            "rounds": sorted({i.round for i in infos if i.round is not None}),
            "group_sizes": dict(sorted(Counter(i.group_size for i in infos).items())),
            "errors": errors_of(results),
            **daemon_rounds(clients, "scale-random/", since),
        })
        _log(f"random cells, call {call}/{calls}: MSE ratio {rows[-1]['mse_ratio']:.3g}, "
             f"{rows[-1]['call_max_s']:.2f} s, rounds {rows[-1]['rounds']}, group sizes "
             f"{rows[-1]['group_sizes']}" + (f", {len(rows[-1]['errors'])} ERRORS"
                                             if rows[-1]["errors"] else ""))
    # the drift of the mean shows mass lost or double-counted (it must stay put)
    drift = float((torch.stack(values).double().mean(0) - mean).abs().max())
    return {"key": "scale-random", "elems": elems, "calls": rows,
            "cells_occupied": len(coords), "cells": grid.cells,
            "max_per_cell": max(coords.values(), default=0), "mean_drift": drift}


def terminate_all(swarm: LocalSwarm, timeout: float = 10.0) -> None:
    """SIGTERM every daemon at once and wait for them, so LocalSwarm.stop() only has stragglers
    left instead of stopping 64 daemons one after another (and sends no second SIGTERM to a
    daemon already shutting down)."""
    for d in swarm.daemons:
        if d.alive():
            with contextlib.suppress(ProcessLookupError):
                d.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for d in swarm.daemons:
        with contextlib.suppress(subprocess.TimeoutExpired):
            d.proc.wait(max(deadline - time.monotonic(), 0.01))


# --- output -------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max", type=int, default=64, help="daemons in the swarm (default 64)")
    p.add_argument("--grid", help="grid for the rounds, e.g. 4x4x4 (default: the smallest "
                                  "MxMxM with M^3 >= --max)")
    p.add_argument("--elems", type=int, default=10_000, help="float32 elements per peer")
    p.add_argument("--idle", type=float, default=5.0, help="idle seconds before measuring")
    p.add_argument("--calls", type=int, default=6, help="one-round calls without coords")
    p.add_argument("--timeout", type=float, default=60.0, help="Client.average timeout")
    p.add_argument("--skip-probe", action="store_true", help="skip the client process probe")
    p.add_argument("--json", action="store_true", help="print one JSON object, not the report")
    p.add_argument("--workdir", help="keep daemon logs and sockets here")
    p.add_argument("--daemon-log-level", default="INFO", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def run(args: argparse.Namespace, grid: Grid) -> dict[str, Any]:
    report: dict[str, Any] = {"daemons": args.max, "grid": "x".join([str(grid.size)] * grid.dims),
                              "code": code_version(),
                              "mem_available_before_mb": mem_available_mb()}
    torch.set_num_threads(1)
    t0 = time.monotonic()
    try:
        swarm = LocalSwarm(args.max, workdir=args.workdir, log_level=args.daemon_log_level)
        with swarm:
            report["start_s"] = time.monotonic() - t0
            pids = [d.proc.pid for d in swarm.daemons]
            metrics = [str(d.info["metrics"]) for d in swarm.daemons]
            _log(f"{args.max} daemons up in {report['start_s']:.1f} s ({swarm.workdir}); "
                 f"idle for {args.idle:.0f} s")
            try:
                usage = Usage(pids, metrics)
                time.sleep(args.idle)
                report["idle_usage"] = usage.stop()
                report["idle_seconds"] = args.idle
                report["idle"] = memory_stats(pids)
                _log(f"idle RSS median {report['idle']['rss_median_mb']:.1f} MB, max "
                     f"{report['idle']['rss_max_mb']:.1f} MB")
                if not args.skip_probe:
                    report["client_process"] = probe_client_process(swarm, args.elems,
                                                                    args.timeout)
                    _log(f"client process: {report['client_process']}")
                clients = [moshpit.Client(sock) for sock in swarm.sockets]
                try:
                    if grid.cells == args.max:
                        report["full_grid"] = full_grid(clients, grid, args.elems, args.timeout,
                                                        pids, metrics)
                        _log(f"full grid: {report['full_grid']['wall_s']:.2f} s, max error "
                             f"{report['full_grid']['max_abs_error']}")
                    else:
                        _log(f"--max {args.max} != {grid.cells} cells: no full-grid check")
                    report["after_rounds"] = memory_stats(pids)
                    report["random_cells"] = random_cells(clients, grid, args.elems,
                                                          args.calls, args.timeout, pids,
                                                          metrics)
                    report["after_rounds"] = memory_stats(pids)
                finally:
                    for c in clients:
                        c.close()
            finally:
                dead = [d.name for d in swarm.daemons if not d.alive()]
                if dead:
                    _log(f"daemons died early: {dead}")
                t1 = time.monotonic()
                terminate_all(swarm)
                codes = swarm.stop()
                report["stop"] = {"seconds": time.monotonic() - t1, "codes": dict(Counter(codes)),
                                  "died_early": dead}
    except LaunchError as exc:
        raise BenchError(f"swarm did not start after {time.monotonic() - t0:.1f} s: {exc}") \
            from exc
    return report


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max < 2:
        parser.error("--max must be at least 2")
    try:
        if args.grid:
            grid = Grid.parse(args.grid)
        else:
            side = max(2, math.ceil(round(args.max ** (1 / 3), 9)))
            grid = Grid(side, 3)
    except GridError as exc:
        parser.error(str(exc))
    exit_on_sigterm()
    try:
        report = run(args, grid)
    except BenchError as exc:
        print(f"bench.scale: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench.scale: interrupted; daemons stopped", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
