"""`python -m bench.internet`: a swarm of thousands of daemons on a simulated internet.

Every peer is a MoshpitNode (the daemon's own DHT, matchmaking, butterfly round, deadlines and
sessions) on moshpitd/virtual's event loop and network, in this one process: virtual time jumps
over waits, so the run costs only the CPU the protocol's code takes. Links are drawn per host
(docs/scale.md cites the measurements behind the defaults): a one-way delay to the core, an
uplink and a downlink rate, a datagram loss rate. `--churn` kills peers (their processes die:
connections reset, nothing drained) and starts new ones, at that many of each per hour.

Rounds are synchronous, as in the paper's averaging experiment: every live peer starts round r
at once (or up to --jitter s late) and the next starts when all have finished. Per round the
report gives the mean squared distance of the peers' vectors to the swarm's mean (the mean of
the initial vectors; with churn, the spread around the present peers' mean as well), group
sizes, virtual matchmaking and round times, DHT datagrams and bytes per peer, failed rounds,
and the wall time the round took here.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import math
import resource
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from moshpitd.config import BY_KEY
from moshpitd.matchmaking.grid import Grid
from moshpitd.rounds import AverageResult
from moshpitd.virtual import loop as vloop
from moshpitd.virtual.net import Link, Network
from moshpitd.virtual.swarm import Peer, Swarm

MBIT = 1e6 / 8


@dataclass(frozen=True)
class Dist:
    """A distribution of a link parameter: const:X, lognormal:MEDIAN:SIGMA, gamma:SHAPE:MEAN,
    uniform:LO:HI."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Dist:
        kind, _, rest = text.partition(":")
        try:
            nums = [float(x) for x in rest.split(":")] if rest else []
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: numbers after the kind") from None
        need = {"const": 1, "lognormal": 2, "gamma": 2, "uniform": 2}
        if kind not in need or len(nums) != need[kind]:
            raise argparse.ArgumentTypeError(
                f"{text!r}: want const:X, lognormal:MEDIAN:SIGMA, gamma:SHAPE:MEAN or "
                "uniform:LO:HI")
        return cls(kind, *nums)

    def __str__(self) -> str:
        nums = [self.a] if self.kind == "const" else [self.a, self.b]
        return ":".join([self.kind, *(f"{x:g}" for x in nums)])

    def draw(self, rng: np.random.Generator) -> float:
        if self.kind == "const":
            return self.a
        if self.kind == "lognormal":
            return float(self.a * math.exp(self.b * rng.standard_normal()))
        if self.kind == "gamma":
            return float(rng.gamma(self.a, self.b / self.a))
        return float(rng.uniform(self.a, self.b))


def parse_grid(text: str) -> Grid:
    parts = [int(x) for x in text.lower().split("x")]
    if len(set(parts)) != 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a grid is M x M x ... (equal sides)")
    return Grid(parts[0], len(parts))


def draw_link(args: argparse.Namespace, rng: np.random.Generator) -> Link:
    return Link(delay=max(args.delay.draw(rng), 0.0) / 1000,
                up=max(args.up.draw(rng), 0.1) * MBIT,
                down=max(args.down.draw(rng), 0.1) * MBIT,
                loss=min(max(args.loss.draw(rng), 0.0), 1.0))


def round_row(r: int, peers: list[Peer], before: dict[str, int], truth: np.ndarray[Any, Any],
              wall: float, started: float, now: float, sent: dict[str, int]) -> dict[str, Any]:
    results = [p.results[-1] for p in peers if len(p.results) > r]
    ok = [x for x in results if isinstance(x, AverageResult) and x.rounds]
    records = [x.rounds[-1] for x in ok]
    failed = len(results) - sum(1 for rec in records if rec.result == "ok")
    vectors = np.stack([p.vector for p in peers]).astype(np.float64)
    err = float(np.mean(np.sum((vectors - truth) ** 2, axis=1)))
    spread = float(np.mean(np.sum((vectors - vectors.mean(0)) ** 2, axis=1)))
    worst = [p.index for p in peers if float(np.max(np.abs(p.vector - truth))) > 1e-5]
    n = max(len(peers), 1)
    return {
        "round": r, "peers": len(peers), "mse_to_mean": err, "spread": spread,
        "off_mean": len(worst), "off_mean_peers": worst[:16],
        "group_sizes": dict(sorted(Counter(rec.group_size for rec in records).items())),
        "results": dict(Counter(rec.result for rec in records)),
        "errors": dict(Counter(type(x).__name__ for x in results
                               if not isinstance(x, AverageResult))),
        "failed": failed,
        "matchmaking_s": _quantiles([rec.matchmaking_seconds for rec in records]),
        "round_s": _quantiles([rec.seconds for rec in records]),
        "virtual_s": now - started,
        "dht_datagrams_per_peer": (sent.get("datagrams", 0) - before.get("datagrams", 0)) / n,
        "dht_bytes_per_peer": (sent.get("datagram_bytes", 0)
                               - before.get("datagram_bytes", 0)) / n,
        "stream_bytes_per_peer": (sent.get("stream_bytes", 0)
                                  - before.get("stream_bytes", 0)) / n,
        "wall_s": wall,
    }


def _quantiles(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    xs = sorted(xs)
    return {"median": statistics.median(xs), "p90": xs[int(0.9 * (len(xs) - 1))],
            "max": xs[-1]}


def totals(peers: list[Peer], gone: Counter[str]) -> dict[str, int]:
    out = Counter(gone)
    for p in peers:
        out.update(p.host.sent)
    return dict(out)


async def simulate(args: argparse.Namespace) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    net = Network(loop, seed=args.seed)  # type: ignore[arg-type]
    rng = np.random.default_rng(args.seed)
    swarm = Swarm(net, args.elems, **args.options)
    grid: Grid = args.grid
    cells = list(grid.all_cells())
    fill = args.peers == grid.cells and not args.churn
    t0 = time.perf_counter()
    vectors = rng.standard_normal((args.peers, args.elems)).astype(np.float32)
    for i in range(args.peers):
        offset = float(rng.normal(0.0, args.clock_skew)) if args.clock_skew else 0.0
        await swarm.add(draw_link(args, rng), vectors[i], offset)
    truth = vectors.astype(np.float64).mean(0)
    setup = {"wall_s": time.perf_counter() - t0, "virtual_s": loop.time()}
    _log(f"{args.peers} peers up: {setup['wall_s']:.1f} s here, {loop.time():.1f} s virtual")
    lookups = await check_lookups(swarm, args.check_lookups) if args.check_lookups else None
    gone: Counter[str] = Counter()
    churn = {"left": 0, "joined": 0}
    churner = (asyncio.ensure_future(_churn(args, swarm, rng, gone, churn))
               if args.churn else None)
    rows = []
    for r in range(args.rounds):
        start, w0 = loop.time(), time.perf_counter()
        before = totals(swarm.peers, gone)
        tasks = [swarm.average(p, "sim", args.timeout, grid=grid,
                               initial_coords=cells[p.index] if fill else None,
                               after=float(rng.uniform(0, args.jitter)))
                 for p in list(swarm.peers)]
        await asyncio.gather(*tasks, return_exceptions=True)
        row = round_row(r, swarm.peers, before, truth, time.perf_counter() - w0, start,
                        loop.time(), totals(swarm.peers, gone))
        rows.append(row)
        _log(f"round {r}: mse {row['mse_to_mean']:.3e} spread {row['spread']:.3e}, "
             f"groups {row['group_sizes']}, failed {row['failed']}, "
             f"{row['dht_datagrams_per_peer']:.1f} DHT datagrams/peer, "
             f"{row['virtual_s']:.2f} s virtual, {row['wall_s']:.1f} s here")
    if churner is not None:
        churner.cancel()
    off = explain_off_mean(swarm.peers, truth, grid.size)
    await swarm.stop()
    return {"peers": args.peers, "grid": [grid.size, grid.dims], "elems": args.elems,
            "filled": fill, "rounds": rows, "setup": setup, "churn": churn, "lookups": lookups,
            "off_mean": off, "off_mean_why": dict(Counter(o["why"] for o in off)),
            "wall_s": time.perf_counter() - t0, "virtual_s": loop.time(),
            "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "links": {k: str(getattr(args, k)) for k in ("delay", "up", "down", "loss")}}


async def check_lookups(swarm: Swarm, keys: int, askers: int = 20) -> dict[str, Any]:
    """How well the DHT's lookups agree: for `keys` keys, `askers` random peers each look up the
    nodes that hold its records (the daemon's own `_nearest`), against the true closest by XOR
    distance. Records stored through one answer and read through another are not seen."""
    rng = np.random.default_rng(1)
    ids = [p.node.peer_id for p in swarm.peers]
    found, distinct, datagrams = [], [], []
    for k in range(keys):
        key = hashlib.sha1(f"lookup-check-{k}".encode()).digest()
        target = int.from_bytes(key, "big")
        replicas = swarm.peers[0].node.dht.protocol.replicas
        true = set(sorted(ids, key=lambda i: int.from_bytes(i, "big") ^ target)[:replicas])
        chosen = [swarm.peers[int(i)] for i in rng.choice(len(swarm.peers), askers, False)]
        before = sum(p.host.sent["datagrams"] for p in swarm.peers)
        answers = await asyncio.gather(*(p.host.start(p.node.dht._nearest(key))
                                         for p in chosen))
        datagrams.append((sum(p.host.sent["datagrams"] for p in swarm.peers) - before) / askers)
        sets = [frozenset(bytes(n.id) for n in a[:replicas]) for a in answers]
        found += [len(s & true) / replicas for s in sets]
        distinct.append(len(set(sets)))
    out = {"true_replicas_found": float(np.mean(found)), "distinct_answers": distinct,
           "datagrams_per_lookup": float(np.mean(datagrams))}
    _log(f"lookups: {out}")
    return out


def explain_off_mean(peers: list[Peer], truth: np.ndarray[Any, Any], line: int
                     ) -> list[dict[str, Any]]:
    """Every peer whose vector is not the swarm's mean, with its rounds: which were short of a
    full line (alone, a split group, failed) and its link, so a run says who and why."""
    out = []
    for p in peers:
        error = float(np.max(np.abs(p.vector - truth)))
        if error <= 1e-5:
            continue
        rounds: list[dict[str, Any]] = []
        for x in p.results:
            if isinstance(x, AverageResult) and x.rounds:
                rec = x.rounds[-1]
                rounds.append({"round": x.last_round, "result": rec.result,
                               "group": rec.group_size,
                               "matchmaking_s": round(rec.matchmaking_seconds, 3)})
            else:
                rounds.append({"error": f"{type(x).__name__}: {x}"[:120]})
        short = [r for r in rounds if r.get("result") != "ok" or r.get("group", 0) < line]
        why = ("inherited: its own groups were full lines; one it averaged with had "
               "a short round") if not short else (
            "split group" if short[0].get("result") == "ok" else short[0].get("result", "error"))
        link = p.host.link
        out.append({"peer": p.index, "ip": p.host.ip, "max_error": error, "why": why,
                    "rounds": rounds, "link": {"delay_ms": round(link.delay * 1000, 1),
                                               "up_mbit": round(link.up / MBIT, 1),
                                               "down_mbit": round(link.down / MBIT, 1)}})
    return out


async def _churn(args: argparse.Namespace, swarm: Swarm, rng: np.random.Generator,
                 gone: Counter[str], counts: dict[str, int]) -> None:
    """Leaves and joins, each a Poisson process at --churn per hour."""
    rate = 2 * args.churn / 3600.0
    joining: set[asyncio.Future[Peer]] = set()
    while True:
        await asyncio.sleep(float(rng.exponential(1 / rate)))
        if rng.random() < 0.5 and len(swarm.peers) > 2:
            peer = swarm.peers[int(rng.integers(len(swarm.peers)))]
            gone.update(peer.host.sent)
            await swarm.leave(peer)
            counts["left"] += 1
        else:
            donor = swarm.peers[int(rng.integers(len(swarm.peers)))]
            join = asyncio.ensure_future(swarm.add(draw_link(args, rng), donor.vector))
            joining.add(join)
            join.add_done_callback(joining.discard)
            counts["joined"] += 1


def _log(msg: str) -> None:
    print(f"[bench.internet] {msg}", file=sys.stderr, flush=True)


def default_grid(peers: int) -> Grid:
    """The smallest square grid with a cell per peer (32x32 for 1,024, the paper's)."""
    return Grid(max(math.ceil(math.sqrt(peers)), 2), 2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.internet", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", type=int, default=1024)
    p.add_argument("--grid", type=parse_grid, help="e.g. 32x32 (default: the smallest square "
                   "grid with a cell per peer)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--elems", type=int, default=1024, help="float32 elements per peer")
    p.add_argument("--timeout", type=float, default=30.0, help="each round's request timeout")
    p.add_argument("--delay", type=Dist.parse, default=Dist("gamma", 2, 25),
                   help="one-way delay host-core in ms (default gamma:2:25: pair round trips "
                   "average 100 ms)")
    p.add_argument("--up", type=Dist.parse, default=Dist("lognormal", 20, 0.8),
                   help="uplink Mbit/s (default lognormal:20:0.8)")
    p.add_argument("--down", type=Dist.parse, default=Dist("lognormal", 300, 0.8),
                   help="downlink Mbit/s (default lognormal:300:0.8)")
    p.add_argument("--loss", type=Dist.parse, default=Dist("const", 0.002),
                   help="datagram loss rate (default const:0.002)")
    p.add_argument("--jitter", type=float, default=0.0,
                   help="each peer starts each round up to this many s late (uniform): "
                   "trainers' steps never end at one instant")
    p.add_argument("--clock-skew", type=float, default=0.0,
                   help="standard deviation of the hosts' wall clocks, s")
    p.add_argument("--churn", type=float, default=0.0,
                   help="peers leaving, and as many joining, per hour")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a daemon option for every peer (moshpitd's config keys), repeatable")
    p.add_argument("--check-lookups", type=int, default=0, metavar="KEYS",
                   help="before the rounds, check how well DHT lookups of KEYS keys agree")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", help="write a PNG of convergence against virtual time")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--log-level", default="ERROR", help="the daemons' log level")
    args = p.parse_args(argv)
    args.grid = args.grid or default_grid(args.peers)
    args.options = {}
    for item in args.option:
        key, _, value = item.partition("=")
        if key not in BY_KEY or not value:
            p.error(f"--option {item!r}: want KEY=VALUE with a moshpitd option")
        args.options[key] = BY_KEY[key].parse(value)
    if args.peers < 2 or args.rounds < 1:
        p.error("need --peers >= 2 and --rounds >= 1")
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    logging.getLogger("rpcudp").setLevel(logging.CRITICAL)  # as the daemon has it (logs.py)
    out = vloop.run(lambda: simulate(args))
    if args.plot:
        plot(out, args.plot)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        report(out)
    return 0


def report(out: dict[str, Any]) -> None:
    print(f"{out['peers']} peers, grid {'x'.join([str(out['grid'][0])] * out['grid'][1])}, "
          f"{out['elems']} float32 each, links {out['links']}")
    print(f"{'round':>5} {'mse':>10} {'spread':>10} {'off':>5} {'failed':>6} {'mm p50':>7} "
          f"{'round p50':>9} {'virtual':>8} {'dht/peer':>8} {'dht B/peer':>10} {'wall s':>7}")
    for r in out["rounds"]:
        mm = r["matchmaking_s"]["median"] if r["matchmaking_s"] else float("nan")
        rs = r["round_s"]["median"] if r["round_s"] else float("nan")
        print(f"{r['round']:>5} {r['mse_to_mean']:>10.3e} {r['spread']:>10.3e} "
              f"{r['off_mean']:>5} {r['failed']:>6} {mm:>7.2f} {rs:>9.2f} "
              f"{r['virtual_s']:>8.2f} {r['dht_datagrams_per_peer']:>8.1f} "
              f"{r['dht_bytes_per_peer']:>10.0f} {r['wall_s']:>7.1f}")
    if out["off_mean"]:
        print(f"{len(out['off_mean'])} peers not at the mean at the end, first result short of "
              f"a full line: {out['off_mean_why']}")
        for o in out["off_mean"][:5]:
            print(f"  peer {o['peer']} {o['link']}: {o['rounds']}")
    print(f"wall {out['wall_s']:.1f} s here for {out['virtual_s']:.1f} s virtual; "
          f"max RSS {out['max_rss_mb']:.0f} MB; churn {out['churn']}")


def plot(out: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t = [0.0]
    mse = []
    for r in out["rounds"]:
        t.append(t[-1] + r["virtual_s"])
        mse.append(max(r["mse_to_mean"], 1e-30))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.semilogy(t[1:], mse, "o-", label="mean squared distance to the mean")
    ax.set_xlabel("virtual seconds")
    ax.set_ylabel("MSE")
    ax.set_title(f"{out['peers']} peers on a simulated internet")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    sys.exit(main())
