"""`python -m bench.local_groups`: several trainers per host, through one daemon as one peer
(local_world, replicas) against every trainer with its own daemon as its own peer.

H hosts of K trainers each average one float32 vector; every trainer keeps its tensors in
memory shared with its daemon (Client.share), so no call copies them. A round's time is what
the trainers wait for in Client.average; a host's bytes are what its daemon(s) sent in it.
The two layouts take turns --passes times on the same machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

import moshpit
from bench.allreduce import parse_elems
from bench.cli import exit_on_sigterm, positive, print_columns
from moshpitd.launcher import LocalSwarm


def rounds(layout: str, hosts: int, per_host: int, elems: int, repeat: int,
           timeout: float) -> tuple[list[float], list[int]]:
    """(seconds per round, bytes sent per host per round) of `repeat` timed rounds."""
    local = layout == "local"
    with LocalSwarm(hosts if local else hosts * per_host) as swarm:
        trainers = hosts * per_host
        clients = [moshpit.Client(swarm.sockets[t // per_host if local else t])
                   for t in range(trainers)]
        tensors = [c.share([torch.randn(elems, generator=torch.Generator().manual_seed(t))])
                   for t, c in enumerate(clients)]
        args: dict[str, Any] = dict(timeout=timeout, group_size=hosts if local else trainers,
                                    min_group_size=hosts if local else trainers)
        if local:
            args["local_world"] = per_host
        seconds, sent = [], []
        with ThreadPoolExecutor(trainers) as pool:
            for r in range(repeat + 1):  # the first round warms up
                def call(t: int, r: int = r) -> float:
                    start = time.perf_counter()
                    clients[t].average(tensors[t], key=f"bench-{r}", **args)
                    return time.perf_counter() - start
                waits = list(pool.map(call, range(trainers)))
                sent_by = [c.last_round.bytes_sent if c.last_round else 0 for c in clients]
                # a local group's trainers all report their host's one round
                host_bytes = [sent_by[h * per_host] if local else
                              sum(sent_by[h * per_host:(h + 1) * per_host])
                              for h in range(hosts)]
                if r:
                    seconds.append(max(waits))
                    sent.append(int(statistics.mean(host_bytes)))
        for c in clients:
            c.close()
    return seconds, sent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.local_groups", description=__doc__)
    p.add_argument("--hosts", type=positive, default=2, help="daemons standing for hosts (2)")
    p.add_argument("--per-host", type=positive, default=2, help="trainers per host (2)")
    p.add_argument("--elems", type=parse_elems, default=4 << 20, metavar="E",
                   help="float32 elements (default 4M)")
    p.add_argument("--repeat", type=positive, default=3, help="timed rounds per pass (3)")
    p.add_argument("--passes", type=positive, default=1, help="turns of the two layouts (1)")
    p.add_argument("--timeout", type=float, default=60.0, help="per-round timeout, s (60)")
    a = p.parse_args(argv)
    exit_on_sigterm()
    results: dict[str, tuple[list[float], list[int]]] = {"local": ([], []), "peers": ([], [])}
    for _ in range(a.passes):
        for layout in results:
            s, b = rounds(layout, a.hosts, a.per_host, a.elems, a.repeat, a.timeout)
            results[layout][0].extend(s)
            results[layout][1].extend(b)
    cells = [["layout", "peers", "median s/round", "MB sent/host/round"]]
    for layout, (s, b) in results.items():
        peers = a.hosts if layout == "local" else a.hosts * a.per_host
        cells.append([f"{layout} ({a.hosts} x {a.per_host})", str(peers),
                      f"{statistics.median(s):.3f}", f"{statistics.median(b) / 1e6:.1f}"])
    print_columns(cells)
    (ls, lb), (ps, pb) = results["local"], results["peers"]
    print(f"local / peers: time {statistics.median(ls) / statistics.median(ps):.2f}, "
          f"bytes {statistics.median(lb) / statistics.median(pb):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
