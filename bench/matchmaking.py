"""`python -m bench.matchmaking`: how long peers that are all ready at once wait for a group.

hivemind's matchmaking waits a fixed few seconds for a group; moshpit's aims to assemble a full
group as soon as it exists (issue goal: <= 0.1 s on this machine). Two scenarios, each on its own
LocalSwarm of real daemons, one trainer-like worker process per daemon:

* plain: P peers call `average(key=f"mm-{i}", group_size=P)` together, a fresh key per repeat;
* grid: M^d peers fill an MxM.. grid with initial_coords and call `average(key="mmgrid",
  grid=(M, d))` together, one round per call, so consecutive calls walk the grid's rounds.

Workers are started fresh (`python -m bench.matchmaking --worker`, never forked) and released by
one JSON "go" line each, carrying a wall-clock start time a little in the future: every worker
sleeps until that instant, so the calls start together up to the scheduler's wake-up jitter
(reported as `skew`: a few ms, tens of ms while 16 daemons keep both cores busy). One warm-up
call per scenario (first connections, for the grid also choosing cells) is reported apart.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from bench.cli import exit_on_sigterm, print_columns
from bench.procs import BenchError, Child, Children, child_env
from bench.usage import Usage

GOAL_SECONDS = 0.1
START_DELAY = 0.1  # go lines carry "start at now + this": enough for every worker to wake up

Request = dict[str, Any]


# --- the worker (one per daemon, like a trainer) -------------------------------------------
def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def worker(socket_path: str, elems: int) -> int:
    """Average torch.ones(elems) as told by JSON lines on stdin; one JSON line back per call."""
    import torch

    import moshpit

    torch.set_num_threads(1)
    tensor = torch.ones(elems)
    with moshpit.Client(socket_path) as client:
        emit({"ready": True, "peer_id": client.peer_id, "pid": os.getpid()})
        for line in sys.stdin:
            msg = json.loads(line)
            if msg.get("op") == "quit":
                break
            late = time.time() - float(msg["at"])
            if late < 0:
                time.sleep(-late)
            started = time.time()
            t0 = time.perf_counter()
            try:
                (out,) = client.average(
                    [tensor], key=msg["key"], timeout=msg["timeout"],
                    group_size=msg.get("group_size", 16), grid=msg.get("grid"),
                    rounds=msg.get("rounds", 1), initial_coords=msg.get("initial_coords"))
            except moshpit.MoshpitError as exc:
                emit({"error": f"{type(exc).__name__}: {exc}", "started": started,
                      "seconds": time.perf_counter() - t0})
                continue
            seconds = time.perf_counter() - t0
            info = client.last_round
            assert info is not None
            emit({"seconds": seconds, "daemon_seconds": info.seconds,
                  "matchmaking_seconds": info.matchmaking_seconds,
                  "group_size": info.group_size, "round": info.round,
                  "coords": info.coords, "started": started, "late": max(late, 0.0),
                  "max_error": float((out - 1.0).abs().max())})
    return 0


# --- the orchestrator ---------------------------------------------------------------------
def _log(msg: str) -> None:
    print(f"[bench.matchmaking] {msg}", file=sys.stderr, flush=True)


def code_version() -> dict[str, Any]:
    """Which daemon code was measured: the commit and how many files differ from it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "moshpitd",
                                "client"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty_files": None}
    return {"commit": commit or None, "dirty_files": len(dirty.splitlines())}


def p90(values: list[float]) -> float:
    """Nearest-rank 90th percentile: a value that was actually observed."""
    ordered = sorted(values)
    return ordered[max(math.ceil(0.9 * len(ordered)) - 1, 0)]


def run_call(workers: list[Child], requests: list[Request], timeout: float,
             daemon_pids: list[int], metrics: list[str]
             ) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Release every worker at the same wall-clock instant; one reply from each, plus the
    resources used from that instant to the last reply."""
    usage = Usage(daemon_pids, metrics)
    at = time.time() + START_DELAY
    for w, req in zip(workers, requests, strict=True):
        w.send(json.dumps({**req, "at": at}))
    replies = [w.recv(timeout + 30.0) for w in workers]
    return replies, usage.stop(since=at)


def summarize_call(replies: list[dict[str, Any]], full: int,
                   usage: dict[str, float]) -> dict[str, Any]:
    """A call's numbers: the slowest peer's (the round is done when the last peer is)."""
    ok = [r for r in replies if "error" not in r]
    out: dict[str, Any] = {
        "errors": [f"peer {i}: {r['error']}" for i, r in enumerate(replies) if "error" in r],
        "failed_peers": [i for i, r in enumerate(replies) if "error" in r],
        "skew_s": max(r["started"] for r in replies) - min(r["started"] for r in replies),
        "late_max_s": max(r.get("late", 0.0) for r in replies),
        "call_s": max(r["seconds"] for r in replies),
        **usage,
    }
    if ok:
        out.update({
            "matchmaking_s": max(r["matchmaking_seconds"] for r in ok),
            "matchmaking_min_s": min(r["matchmaking_seconds"] for r in ok),
            "reduce_s": max(r["daemon_seconds"] - r["matchmaking_seconds"] for r in ok),
            "group_sizes": sorted(r["group_size"] for r in ok),
            "rounds": sorted({r["round"] for r in ok if r["round"] is not None}),
            "max_error": max(r["max_error"] for r in ok),
            # the daemon reports a peer that found no group as a group of one with 0 s of
            # matchmaking: such peers are counted here, not hidden in the max above
            "short_peers": sum(r["group_size"] < full for r in ok),
            "matchmaking_per_peer_s": [r["matchmaking_seconds"] for r in replies
                                       if "error" not in r],
        })
    out["full"] = len(ok) == len(replies) and all(s == full for s in out.get("group_sizes", []))
    return out


def scenario(name: str, daemons: int, full: int, request: Callable[[int, int], Request],
             repeat: int, elems: int, timeout: float, workdir: str | None,
             log_level: str) -> dict[str, Any]:
    """One LocalSwarm of `daemons`, one worker each; a warm-up call then `repeat` timed calls.
    request(call, peer) is what peer sends in call (0 = warm-up)."""
    from moshpitd.launcher import LaunchError, LocalSwarm

    where = None if workdir is None else os.path.join(workdir, name)
    try:
        swarm = LocalSwarm(daemons, workdir=where, log_level=log_level).start()
    except LaunchError as exc:
        raise BenchError(f"{name}: swarm did not start: {exc}") from exc
    calls: list[dict[str, Any]] = []
    timed_usage: dict[str, float] = {}
    try:
        _log(f"{name}: {daemons} daemons up in {swarm.workdir}")
        with Children() as kids:
            workers = [kids.start(f"{name} worker {i}", "bench.matchmaking",
                                  ["--worker", "--socket", sock, "--elems", str(elems)],
                                  child_env())
                       for i, sock in enumerate(swarm.sockets)]
            for w in workers:
                w.recv(120.0)
            pids = [d.proc.pid for d in swarm.daemons]
            metrics = [d.info["metrics"] for d in swarm.daemons]
            overall = Usage(pids)
            for call in range(1 + repeat):
                if call == 1:
                    overall = Usage(pids)
                replies, usage = run_call(
                    workers, [request(call, i) for i in range(daemons)], timeout, pids, metrics)
                s = summarize_call(replies, full, usage)
                calls.append(s)
                label = "warm-up" if call == 0 else f"{call}/{repeat}"
                _log(f"{name} {label}: mm {s.get('matchmaking_s', math.nan):.3f} s, call "
                     f"{s['call_s']:.3f} s, skew {1000 * s['skew_s']:.1f} ms (latest start "
                     f"{1000 * s['late_max_s']:.1f} ms late), daemon CPU "
                     f"{s['daemon_cpu_s']:.2f} s, {s['dht_datagrams_per_daemon_round']:.0f} DHT "
                     "datagrams per daemon, groups "
                     f"{s.get('group_sizes')}" + (f", ERRORS {s['errors']}" if s["errors"]
                                                  else ""))
            timed_usage = overall.stop()
            for w in workers:
                w.send(json.dumps({"op": "quit"}))
        failed = sorted({i for c in calls for i in c["failed_peers"]})
        for i in failed:
            _log(f"--- {swarm.daemons[i].name} (peer {i}) log tail ---\n"
                 f"{swarm.daemons[i].log_tail(15)}")
        if failed and workdir is None:
            _log("rerun with --workdir DIR [--daemon-log-level DEBUG] to keep the daemon logs")
    finally:
        dead = [d.name for d in swarm.daemons if not d.alive()]
        codes = swarm.stop()
        if dead or any(codes):
            _log(f"{name}: daemons died early {dead}, exit codes {codes}")
    timed = calls[1:]
    ok = [c for c in timed if "matchmaking_s" in c]
    mm = [c["matchmaking_s"] for c in ok]
    whole = [c["call_s"] for c in timed]
    return {
        "scenario": name, "daemons": daemons, "group_size": full, "repeat": repeat,
        "elems": elems,
        "matchmaking_median_s": statistics.median(mm) if mm else None,
        "matchmaking_p90_s": p90(mm) if mm else None,
        "matchmaking_max_s": max(mm) if mm else None,
        "call_median_s": statistics.median(whole), "call_p90_s": p90(whole),
        "skew_median_s": statistics.median(c["skew_s"] for c in timed),
        "daemon_cpu_median_s": statistics.median(c["daemon_cpu_s"] for c in timed),
        # CPU over the timed calls as one stretch: /proc counts 10 ms ticks, too coarse per call
        "daemon_cores": timed_usage["daemon_cores"],
        "machine_cores": timed_usage["machine_cores"],
        "dht_datagrams_per_daemon_median": statistics.median(
            c["dht_datagrams_per_daemon_round"] for c in timed),
        "full_groups": sum(c["full"] for c in timed),
        "failed_calls": sum(bool(c["errors"]) for c in timed),
        # grid: peers of one call that ended in different rounds fell out of phase
        "out_of_phase_calls": sum(len(c.get("rounds", ())) > 1 for c in timed),
        "warmup": calls[0], "calls": timed,
    }


def fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else "-" if value is None else str(value)


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = [("scenario", "scenario"), ("daemons", "daemons"), ("group_size", "group"),
            ("matchmaking_median_s", "mm med s"), ("matchmaking_p90_s", "mm p90 s"),
            ("matchmaking_max_s", "mm max s"), ("call_median_s", "call med s"),
            ("call_p90_s", "call p90 s"), ("warmup_mm", "warm-up mm s"),
            ("skew_median_s", "skew s"), ("daemon_cpu_median_s", "daemon cpu s"),
            ("daemon_cores", "daemon cores"), ("machine_cores", "machine cores"),
            ("dht_datagrams_per_daemon_median", "dht dgrams"), ("full", "full groups")]
    for r in rows:
        r["warmup_mm"] = r["warmup"].get("matchmaking_s")
        r["full"] = f"{r['full_groups']}/{r['repeat']}"
    cells = [[title for _, title in cols]] + [[fmt(r.get(k)) for k, _ in cols] for r in rows]
    print_columns(cells)
    print()
    for line in (
        "mm = daemon-reported matchmaking_seconds (request to group assembled); call = the whole",
        "Client.average. Per call the slowest peer's, then median / p90 (nearest rank) over the",
        "timed repeats; the warm-up (first) call is apart. skew = spread of the peers' start",
        "instants; daemon cpu = CPU seconds all daemons used in a call; dht dgrams = DHT",
        "datagrams each daemon sent in a call (one round), from its moshpitd_dht_rpcs; medians",
        "over repeats. daemon /",
        "machine cores = CPU time of the daemons / of the whole machine over the stretch of",
        f"timed calls, over its wall time (of {os.cpu_count()} cores; the gap is workers, this",
        "script and anything else running).",
    ):
        print(line)
    for r in rows:
        med, top = r["matchmaking_median_s"], r["matchmaking_p90_s"]
        verdict = ("no successful calls" if med is None else
                   f"median {'meets' if med <= GOAL_SECONDS else 'MISSES'}, p90 "
                   f"{'meets' if top <= GOAL_SECONDS else 'MISSES'}")
        print(f"goal mm <= {GOAL_SECONDS} s, {r['scenario']}: {verdict}")
        if r["out_of_phase_calls"]:
            print(f"WARNING: {r['scenario']}: in {r['out_of_phase_calls']} of {r['repeat']} "
                  "calls the peers ended in different grid rounds")
        short = sum(c.get("short_peers", 0) for c in r["calls"])
        if short:
            print(f"WARNING: {r['scenario']}: {short} peer-calls ended in a group smaller "
                  f"than {r['group_size']}")
        if r["failed_calls"]:
            print(f"WARNING: {r['scenario']}: {r['failed_calls']} of {r['repeat']} calls had "
                  "errors (see stderr / --json)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.matchmaking", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", type=int, default=8, help="daemons for the plain-key scenario")
    p.add_argument("--grid", default="4x4",
                   help="grid of the grid scenario, one daemon per cell (default 4x4)")
    p.add_argument("--repeat", type=int, default=20, help="timed calls per scenario")
    p.add_argument("--elems", type=int, default=1000, help="float32 elements averaged")
    p.add_argument("--timeout", type=float, default=30.0, help="Client.average timeout")
    p.add_argument("--skip-plain", action="store_true")
    p.add_argument("--skip-grid", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object, not a table")
    p.add_argument("--workdir", help="keep daemon logs and sockets here")
    p.add_argument("--daemon-log-level", default="INFO", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--socket", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.socket, args.elems)
    from moshpitd.matchmaking.grid import Grid, GridError

    try:
        grid = Grid.parse(args.grid)
    except GridError as exc:
        parser.error(str(exc))
    if args.peers < 2 or args.repeat < 1 or grid.size < 2:
        parser.error("need --peers >= 2, --repeat >= 1 and a grid side >= 2")
    cells = list(grid.all_cells())
    exit_on_sigterm()
    common = {"timeout": args.timeout}
    rows = []
    try:
        if not args.skip_plain:
            rows.append(scenario(
                f"plain-{args.peers}", args.peers, args.peers,
                lambda call, _: {**common, "key": f"mm-{call}", "group_size": args.peers},
                args.repeat, args.elems, args.timeout, args.workdir, args.daemon_log_level))
        if not args.skip_grid:
            rows.append(scenario(
                f"grid-{args.grid}", len(cells), grid.size,
                lambda _, peer: {**common, "key": "mmgrid", "grid": [grid.size, grid.dims],
                                 "rounds": 1, "initial_coords": list(cells[peer])},
                args.repeat, args.elems, args.timeout, args.workdir, args.daemon_log_level))
    except BenchError as exc:
        print(f"bench.matchmaking: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench.matchmaking: interrupted; workers and daemons stopped", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps({"goal_s": GOAL_SECONDS, "code": code_version(), "rows": rows},
                         indent=2))
    else:
        print_table(rows)
        code = code_version()
        print(f"code: commit {code['commit']}, {code['dirty_files']} changed file(s) under "
              "moshpitd/ and client/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
