"""`python -m bench.allreduce --netns SPEC`: moshpit, gloo and hivemind on the same emulated links.

SPEC lists the hosts' rates (Mbit/s, both directions; `4x100` is four hosts at 100), then
optional `rtt=MS` (round trip added between any two hosts), `loss=PCT` (of the packets each
host receives) and `nat=N` (the last N hosts sit behind NAT routers, netlab/nat.py, alternately
port-preserving and random-port; moshpit's daemons there find themselves private and are
reached through relays at the public ones; gloo and hivemind's averager need every rank to
accept connections, so they do not run): `200,200,20,20`, `4x100,rtt=50,loss=1` or
`4x100,nat=2`. The hosts are network namespaces on
one bridge (netlab): tbf caps each link, nftables drops the loss, the delayer adds the delay.

Each host runs, one system after the other on the same topology: a moshpit daemon with a swarm
key (so its data plane is encrypted and its results checked), the same with `check_results =
off` (moshpit-unchecked: what checks cost), the same with neither (moshpit-plain), the first
with `direct_paths = off` (moshpit-relayed: with nat=N, what direct paths save), one gloo
rank, and
hivemind 1.1.12's DecentralizedAverager (.venv-peers). Every system averages one float32 vector
of the same size in warm-up rounds, then timed rounds; a round's time is its slowest host's.

Bounds, from the round model of moshpitd/allreduce/spans.py with up = down = the host's rate:
`optimum` is the least round time over all span shares (the min-makespan), `equal` the time at
equal shares; for equal rates both are the bandwidth bound, 2 (n - 1) / n vector sizes sent per
host at the link rate. Matchmaking and the all-reduce phase are moshpit's own (RoundInfo).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.cli import print_columns
from bench.procs import ROOT, BenchError, Child, Children, child_env, cpu_seconds
from moshpitd.allreduce.layout import SHARE_CAP
from moshpitd.allreduce.spans import optimal_shares, round_time
from netlab import LinkSpec, Topology, missing_prerequisites, parse_rate

SYSTEMS = ("moshpit", "moshpit-unchecked", "moshpit-plain", "moshpit-relayed", "gloo",
           "hivemind")
GLOO_PORT, HIVEMIND_PORT = 29500, 7900  # one process per namespace: fixed ports
HIVEMIND_PY = ROOT / ".venv-peers" / "bin" / "python"


def parse_spec(text: str) -> list[LinkSpec]:
    """SPEC (module docstring) -> one LinkSpec per host; ValueError says what is wrong."""
    rates: list[float] = []
    rtt_ms, loss = 0.0, 0.0
    for token in (t.strip() for t in text.split(",") if t.strip()):
        key, eq, value = token.partition("=")
        if eq:
            number = float(value.strip().lower().removesuffix("ms").removesuffix("%"))
            if key == "rtt":
                rtt_ms = number
            elif key == "loss":
                loss = number
            elif key != "nat":
                raise ValueError(f"unknown {key!r} in {text!r}: expected rtt=, loss= or nat=")
            continue
        m = re.fullmatch(r"(\d+)x(.+)", token)
        count, rate = (int(m.group(1)), m.group(2)) if m else (1, token)
        rates += [parse_rate(rate if rate[-1].isalpha() else float(rate))] * count
    if len(rates) < 2:
        raise ValueError(f"{text!r}: give at least two hosts' rates, e.g. 4x100 or 200,20")
    return [LinkSpec(r, rtt_ms / 2000, loss) for r in rates]


def nat_kinds(text: str, hosts: int) -> list[str | None]:
    """Each host's NAT (None: public) from SPEC's `nat=N`: the last N, alternating kinds."""
    m = re.search(r"(?:^|,)\s*nat=(\d+)", text)
    n = int(m.group(1)) if m else 0
    if not 0 <= n < hosts:
        raise ValueError(f"nat={n}: at least the first host must be public (it bootstraps)")
    return [None] * (hosts - n) + [("preserve", "random")[i % 2] for i in range(n)]


def bounds(links: list[LinkSpec], nbytes: int) -> dict[str, float]:
    """Round times of the span model (module docstring) for a vector of nbytes."""
    rates = [spec.rate_mbit * 1e6 / 8 for spec in links]
    n, ones = len(rates), [True] * len(rates)
    best = optimal_shares(rates, rates, ones, ones, cap=float(n))
    capped = optimal_shares(rates, rates, ones, ones, cap=SHARE_CAP)
    return {"optimum_s": nbytes * round_time(best, rates, rates, ones),
            "optimum_capped_s": nbytes * round_time(capped, rates, rates, ones),
            "equal_s": nbytes * round_time([1 / n] * n, rates, rates, ones)}


@dataclass
class Result:
    system: str
    seconds: list[float] = field(default_factory=list)
    matchmaking: list[float] = field(default_factory=list)
    reduce: list[float] = field(default_factory=list)
    daemon_cpu: list[float] = field(default_factory=list)
    delayer_cpu: list[float] = field(default_factory=list)
    warmup: list[float] = field(default_factory=list)
    partial: int = 0
    failed: int = 0
    max_error: float = 0.0
    note: str = ""


T0 = time.monotonic()


def _log(msg: str) -> None:
    print(f"[bench +{time.monotonic() - T0:.1f} s] {msg}", file=sys.stderr, flush=True)


def _answers(kids: list[Child], timeout: float) -> list[dict[str, Any]]:
    replies = [c.recv(timeout) for c in kids]
    errors = [f"{c.name}: {r['error']}" for c, r in zip(kids, replies, strict=True) if "error" in r]
    if errors:
        raise BenchError("\n".join(errors))
    return replies


def _delayers(topo: Topology) -> float:
    return sum(topo.delayer_cpu_seconds(h) for h in topo.hosts)


def _rounds(out: Result, topo: Topology, kids: list[Child], warmup: int, repeat: int,
            timeout: float, pids: list[int]) -> None:
    """Warm-up and timed rounds of workers that speak bench.worker's go/check protocol."""
    for rep in range(warmup + repeat):
        cpu, dly = cpu_seconds(pids), _delayers(topo)
        for k in kids:
            k.send(f"go {out.system}-{rep}")
        replies = _answers(kids, timeout + 30.0)
        cpu, dly = cpu_seconds(pids) - cpu, _delayers(topo) - dly
        failed = [f"{k.name}: {r['failed']}" for k, r in zip(kids, replies, strict=True)
                  if "failed" in r]
        if failed:  # a rival's round that gave up: counted, not timed, and the run goes on
            _log(f"{out.system} round {rep} failed: " + "; ".join(failed))
            out.failed += rep >= warmup
            continue
        seconds = max(r["seconds"] for r in replies)
        # a moshpit round may hold every member yet cut a late sender's parts short
        full = (min(r["group_size"] for r in replies) == len(kids)
                and all(r.get("fully_averaged", True) for r in replies))
        _log(f"{out.system} round {rep}: {seconds:.3f} s" + ("" if full else " (partial)"))
        if rep < warmup:
            out.warmup.append(seconds)
            continue
        out.seconds.append(seconds)
        out.partial += not full
        out.daemon_cpu.append(cpu)
        out.delayer_cpu.append(dly)
        if "matchmaking_seconds" in replies[0]:
            out.matchmaking.append(max(r["matchmaking_seconds"] for r in replies))
            out.reduce.append(max(r["daemon_seconds"] - r["matchmaking_seconds"]
                                  for r in replies))
    for k in kids:
        k.send("check")
    errors = [r["max_error"] for r in _answers(kids, 120.0) if r["max_error"] is not None]
    out.max_error = max(errors, default=float("nan"))


def run_moshpit(topo: Topology, args: argparse.Namespace, system: str) -> Result:
    """One daemon per host with a swarm key; trainers (bench.worker) reach them over IPC.
    `moshpit` runs as the key makes it (encrypted, results checked), `moshpit-unchecked`
    with `check_results = off`, `moshpit-plain` with neither encryption nor checks,
    `moshpit-relayed` as `moshpit` but with `direct_paths = off` (hosts behind NAT are reached
    only through their relays)."""
    out = Result(system)
    encrypted = system != "moshpit-plain"
    key = topo.workdir / "swarm.key"
    if not key.exists():
        key.write_text(secrets.token_hex(32))
        key.chmod(0o600)
    extra = ["--swarm-key-file", str(key), "--data-encryption", "auto" if encrypted else "off",
             "--check-results", "auto" if system in ("moshpit", "moshpit-relayed") else "off",
             "--log-level", args.daemon_log_level,
             *(["--no-direct-paths"] if system == "moshpit-relayed" else [])]
    h0, *others = topo.hosts
    first = topo.start_daemon(h0, extra_args=extra, name=f"{out.system}-h1")
    daemons = [first, *(topo.start_daemon(h, [h0], extra, wait=False,
                                          name=f"{out.system}-h{h.index}") for h in others)]
    try:
        from moshpitd.launcher import wait_ready
        for d in daemons[1:]:
            wait_ready(d, 30)
        with Children() as kids:
            workers = [kids.start(f"{out.system} worker {i}", "bench.worker",
                                  ["--socket", d.socket, "--rank", str(i),
                                   "--peers", str(len(daemons)), "--elems", str(args.elems),
                                   "--timeout", str(args.timeout),
                                   "--min-group-size", str(len(daemons))], child_env())
                       for i, d in enumerate(daemons)]
            _answers(workers, 120.0)
            _log(f"{out.system}: daemons and trainers up")
            _rounds(out, topo, workers, args.warmup, args.repeat, args.timeout,
                    [d.proc.pid for d in daemons])
            for w in workers:
                w.send("quit")
    except BenchError as exc:
        tails = "\n".join(f"--- {d.name} ---\n{d.log_tail(15)}" for d in daemons)
        raise BenchError(f"{exc}\n{tails}") from exc
    finally:
        for d in daemons:
            if d.alive():
                d.proc.send_signal(signal.SIGTERM)
        for d in daemons:
            d.stop(timeout=10)
            topo.daemons.remove(d)
    return out


def run_gloo(topo: Topology, args: argparse.Namespace) -> Result:
    """One torch.distributed gloo rank per host, over its eth0; each times its own rounds."""
    out = Result("gloo")
    env = child_env(GLOO_SOCKET_IFNAME="eth0")
    dly = _delayers(topo)
    with Children() as kids:
        ranks = [kids.start(f"gloo rank {h.index - 1}", "bench.gloo_worker",
                            ["--rank", str(h.index - 1), "--peers", str(len(topo.hosts)),
                             "--addr", topo.hosts[0].ip, "--port", str(GLOO_PORT),
                             "--elems", str(args.elems), "--repeat", str(args.repeat),
                             "--warmup", str(args.warmup), "--timeout", str(args.timeout)],
                            env, prefix=h.exec_args())
                 for h in topo.hosts]
        replies = _answers(ranks, 60.0 + args.timeout * (args.warmup + args.repeat))
    out.warmup = [max(t) for t in zip(*(r["warmup"] for r in replies), strict=True)]
    out.seconds = [max(t) for t in zip(*(r["times"] for r in replies), strict=True)]
    out.delayer_cpu = [(_delayers(topo) - dly) / (args.warmup + args.repeat)]
    out.max_error = max(r["max_error"] for r in replies)
    for i, s in enumerate(out.warmup):
        _log(f"gloo round {i}: {s:.3f} s")
    return out


def run_hivemind(topo: Topology, args: argparse.Namespace) -> Result:
    """hivemind's DecentralizedAverager per host (bench/hivemind_avg_worker.py)."""
    out = Result("hivemind")
    python = Path(args.hivemind_python)
    if not python.exists():
        out.note = f"not run: no {python} (make peers installs hivemind 1.1.12 there)"
        return out
    env = child_env()

    def start(kids: Children, i: int, peers: list[str]) -> Child:
        host = topo.hosts[i]
        return kids.start(f"hivemind {i}", "bench.hivemind_avg_worker",
                          ["--ip", host.ip, "--port", str(HIVEMIND_PORT), "--rank", str(i),
                           "--peers", str(len(topo.hosts)), "--elems", str(args.elems),
                           "--timeout", str(args.timeout), "--initial-peers", json.dumps(peers)],
                          env, prefix=host.exec_args(), python=str(python))

    with Children() as kids:
        first = start(kids, 0, [])
        maddrs = _answers([first], 120.0)[0]["maddrs"]
        rest = [start(kids, i, maddrs) for i in range(1, len(topo.hosts))]
        _answers(rest, 120.0)
        _log("hivemind: averagers up")
        workers = [first, *rest]
        _rounds(out, topo, workers, args.warmup, args.repeat, args.timeout,
                [c.proc.pid for c in workers])
        for w in workers:
            w.send("quit")
    out.daemon_cpu = []  # its helper processes are not the children measured: not comparable
    return out


def summarize(res: Result, b: dict[str, float], gloo: float | None) -> dict[str, Any]:
    row: dict[str, Any] = {"system": res.system, "note": res.note, "samples_s": res.seconds,
                           "warmup_s": res.warmup, "partial_rounds": res.partial,
                           "failed_rounds": res.failed,
                           "max_error": res.max_error}
    if not res.seconds:
        return row
    med = statistics.median(res.seconds)
    row.update({"median_s": med, "min_s": min(res.seconds), "max_s": max(res.seconds),
                "x_optimum": med / b["optimum_s"],
                "x_gloo": med / gloo if gloo else None})
    for name, values in (("matchmaking_s", res.matchmaking), ("allreduce_s", res.reduce),
                         ("daemon_cpu_s", res.daemon_cpu), ("delayer_cpu_s", res.delayer_cpu)):
        row[name] = statistics.median(values) if values else None
    if res.reduce:
        row["allreduce_link_use"] = b["optimum_s"] / row["allreduce_s"]
    return row


def fmt(v: Any, pct: bool = False) -> str:
    if v is None:
        return "-"
    return f"{100 * v:.0f} %" if pct else f"{v:.3f}" if isinstance(v, float) else str(v)


def report(out: dict[str, Any]) -> None:
    cols = [("system", "system"), ("median_s", "median s"), ("min_s", "min s"),
            ("max_s", "max s"), ("matchmaking_s", "match s"), ("allreduce_s", "reduce s"),
            ("allreduce_link_use", "reduce/bound"), ("x_optimum", "x bound"),
            ("x_gloo", "x gloo"), ("daemon_cpu_s", "cpu s"), ("delayer_cpu_s", "delayer s"),
            ("partial_rounds", "partial"), ("failed_rounds", "failed")]
    cells = [[t for _, t in cols]]
    for r in out["rows"]:
        cells.append([fmt(r.get(k), k == "allreduce_link_use") for k, _ in cols])
    print(f"netns {out['spec']}: {out['hosts']} hosts, {out['elems']} float32 "
          f"({out['elems'] * 4 / 1e6:.1f} MB), {out['warmup']} warm-up + {out['repeat']} "
          f"timed rounds; load average {out['load_before']} before, {out['load_after']} after")
    if out.get("rtt_ms"):
        print(f"round trips through the delayer (median ms): {out['rtt_ms']}")
    if any(out.get("nat", [])):
        print(f"behind NAT: {out['nat']}; gloo and hivemind cannot run there (every rank must "
              "accept connections), moshpit's private hosts are reached through relays")
    b = out["bounds"]
    print(f"bound (min-makespan of the span model) {b['optimum_s']:.3f} s; with moshpit's "
          f"share cap {b['optimum_capped_s']:.3f} s; equal spans {b['equal_s']:.3f} s\n")
    print_columns(cells)
    for r in out["rows"]:
        if r.get("note"):
            print(f"{r['system']}: {r['note']}")
    print("\nmedian = median over timed rounds of the slowest host's call; match/reduce = "
          "moshpit's\nmatchmaking and all-reduce phase (RoundInfo); reduce/bound = bound / "
          "reduce s; cpu = CPU\nseconds of the daemons (moshpit) or workers (gloo: -) per "
          "round; delayer = the link\nemulation's CPU per round; partial = timed rounds that "
          "did not average\nevery host's whole vector (a split group, or parts cut at the "
          "deadline); failed = timed rounds a system gave up on (hivemind's step\ntimed out "
          "or found no group): not timed; encryption: moshpit and moshpit-unchecked\non, "
          "moshpit-plain off; checked results: moshpit only.")


def main(args: argparse.Namespace) -> int:
    try:
        links = parse_spec(args.netns)
        nats = nat_kinds(args.netns, len(links))
    except ValueError as exc:
        print(f"bench.allreduce: --netns: {exc}", file=sys.stderr)
        return 2
    reason = missing_prerequisites()
    if reason:
        print(f"bench.allreduce: --netns cannot run here: {reason}", file=sys.stderr)
        return 2
    systems = [s.strip() for s in args.systems.split(",")]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        print(f"bench.allreduce: unknown --systems {sorted(unknown)}; known: "
              f"{', '.join(SYSTEMS)}", file=sys.stderr)
        return 2
    b = bounds(links, 4 * args.elems)
    load_before = os.getloadavg()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-netns-"))
    results: list[Result] = []
    try:
        with Topology(len(links), workdir, links=links, nat=nats) as topo:
            _log(f"{len(links)} hosts up")
            rtt = ([topo.ping(topo.hosts[-1], topo.hosts[0])]  # the first host is public
                   if topo.hosts[0].link.delay_s > 0 else [])
            for system in systems:
                _log(f"{system} on {args.netns}")
                if any(nats) and system in ("gloo", "hivemind"):
                    _log(f"{system}: not run: behind NAT, its ranks cannot accept connections")
                    continue
                try:
                    if system == "gloo":
                        results.append(run_gloo(topo, args))
                    elif system == "hivemind":
                        results.append(run_hivemind(topo, args))
                    else:
                        results.append(run_moshpit(topo, args, system))
                except BenchError as exc:  # one system's failure is its row, not the bench's
                    _log(f"{system} failed: {exc}")
                    results.append(Result(system, note=f"failed: {str(exc)[:300]}"))
    except BenchError as exc:
        print(f"bench.allreduce: {exc}", file=sys.stderr)
        return 1
    gloo = next((statistics.median(r.seconds) for r in results
                 if r.system == "gloo" and r.seconds), None)
    out = {"spec": args.netns, "hosts": len(links), "nat": nats, "elems": args.elems,
           "warmup": args.warmup,
           "repeat": args.repeat, "bounds": b, "rtt_ms": rtt,
           "load_before": [round(x, 2) for x in load_before],
           "load_after": [round(x, 2) for x in os.getloadavg()],
           "rows": [summarize(r, b, gloo) for r in results]}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        report(out)
    return 0
