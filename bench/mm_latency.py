"""`python -m bench.mm_latency`: matchmaking time in round trips on an emulated WAN.

On loopback a DHT lookup or a Join costs a few hundred microseconds, so matchmaking's time
there is CPU, not protocol. Here every host is one network namespace whose link adds
--delay seconds each way (netlab's delayer), so each request/response costs one round trip.

Per call, all hosts but the last call `average` at once and wait in matchmaking; the last one
calls --lead seconds later. What is reported is the last member's time from its call to its
group (its call's seconds minus the daemon's all-reduce seconds: the IPC request, the grid
plan if any, declaring, reading, joining and the GroupInfo), in round trips measured on the
same links. Median over --repeat calls after one warm-up call. Two scenarios: a plain key
(a group of all hosts) and a 2x2 grid (one round per call; with 4 hosts, each line is a group
of 2 and the last member's line-mate waits for it). Needs root (see netlab).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

import moshpit
from bench.cli import exit_on_sigterm
from moshpitd.launcher import wait_ready
from netlab import NetnsError, Topology, missing_prerequisites

ELEMS = 1000


def one_call(net: Topology, sockets: list[str], lead: float, request: dict[str, Any],
             coords: list[list[int]] | None) -> dict[str, float]:
    """Everyone but the last host calls at once; the last one `lead` s later. Returns the last
    member's seconds to its group and its call's seconds."""
    out: dict[str, float] = {}
    errors: list[str] = []

    def peer(i: int, delay: float) -> None:
        time.sleep(delay)
        try:
            with moshpit.Client(sockets[i]) as c:
                t0 = time.perf_counter()
                c.average([torch.ones(ELEMS)], **request,
                          initial_coords=None if coords is None else coords[i])
                call = time.perf_counter() - t0
                info = c.last_round
                assert info is not None
                if i == len(sockets) - 1:
                    out["to_group_s"] = call - (info.seconds - info.matchmaking_seconds)
                    out["call_s"] = call
                    out["group_size"] = info.group_size
        except Exception as exc:  # reported, and the call counted as failed
            errors.append(f"peer {i}: {type(exc).__name__}: {exc}")

    last = len(sockets) - 1
    threads = [threading.Thread(target=peer, args=(i, lead if i == last else 0.0))
               for i in range(len(sockets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        print(f"[bench.mm_latency] errors: {errors}", file=sys.stderr)
        return {}
    return out


def scenario(net: Topology, sockets: list[str], name: str, repeat: int, lead: float,
             rtt_s: float, request: Any, coords: list[list[int]] | None) -> dict[str, Any]:
    calls = []
    for call in range(1 + repeat):
        got = one_call(net, sockets, lead, request(call), coords)
        if call > 0 and got:
            calls.append(got)
        print(f"[bench.mm_latency] {name} {'warm-up' if call == 0 else call}: "
              f"{json.dumps({k: round(v, 4) for k, v in got.items()})}", file=sys.stderr)
    to_group = [c["to_group_s"] for c in calls]
    med = statistics.median(to_group) if to_group else None
    return {"scenario": name, "calls_ok": len(calls), "repeat": repeat,
            "to_group_median_s": med, "to_group_median_rtt": None if med is None else med / rtt_s,
            "to_group_s": to_group}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mm_latency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--delay", type=float, default=0.025, help="added one-way delay per link, s")
    p.add_argument("--repeat", type=int, default=8, help="timed calls per scenario")
    p.add_argument("--lead", type=float, default=0.5,
                   help="seconds the others wait in matchmaking before the last one calls")
    p.add_argument("--daemon-args", default="", help="extra daemon arguments, space-separated")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    reason = missing_prerequisites()
    if reason:
        print(f"bench.mm_latency: {reason}", file=sys.stderr)
        return 1
    exit_on_sigterm()
    hosts = 4
    with tempfile.TemporaryDirectory(prefix="mm-latency-") as tmp, \
            Topology(hosts, Path(tmp), rate="1gbit", loss_pct=0, delay=args.delay) as net:
        extra = args.daemon_args.split()
        first = net.start_daemon(net.hosts[0], extra_args=extra)
        rest = [net.start_daemon(h, bootstrap=[net.hosts[0]], extra_args=extra, wait=False)
                for h in net.hosts[1:]]
        for d in rest:
            wait_ready(d, 30)
        sockets = [d.socket for d in [first, *rest]]
        ping = net.ping(net.hosts[0], net.hosts[1], count=10)
        rtt_s = float(ping["tcp_rtt_ms"]) / 1000
        timeout = 10.0
        rows = [
            scenario(net, sockets, f"plain-{hosts}", args.repeat, args.lead, rtt_s,
                     lambda c: {"key": f"lat-{c}", "group_size": hosts, "timeout": timeout},
                     None),
            scenario(net, sockets, "grid-2x2", args.repeat, args.lead, rtt_s,
                     lambda c: {"key": "latgrid", "grid": (2, 2), "rounds": 1,
                                "timeout": timeout},
                     [[0, 0], [0, 1], [1, 0], [1, 1]]),
        ]
    report = {"delay_s": args.delay, "rtt_s": rtt_s, "ping": ping, "rows": rows}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"round trip (TCP echo, median of 10): {1000 * rtt_s:.1f} ms")
    print(f"{'scenario':<10} {'ok':>5} {'to group med s':>15} {'in RTTs':>8}")
    for r in rows:
        med, rtts = r["to_group_median_s"], r["to_group_median_rtt"]
        print(f"{r['scenario']:<10} {r['calls_ok']:>2}/{r['repeat']:<2} "
              f"{'-' if med is None else f'{med:.3f}':>15} "
              f"{'-' if rtts is None else f'{rtts:.1f}':>8}")
    print("to group: the last member's call, from its call to its group (the call minus the "
          "daemon's all-reduce seconds)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except NetnsError as exc:
        print(f"bench.mm_latency: {exc}", file=sys.stderr)
        sys.exit(1)
