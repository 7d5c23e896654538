"""Averaging simulator: the paper's Moshpit All-Reduce experiment (arXiv 2103.03239, §4.1).

Why it exists: the daemon forms groups with moshpitd.matchmaking.grid, and this simulator buckets
peers with that very Grid.group_key and split_bucket, so its convergence numbers speak for the
daemon's keys rather than for a re-implementation. No sockets and no DHT: a round is one step.

Model: N peers hold x_i ~ N(0, 1) and sit on distinct random grid cells (cells filled as evenly
as possible when N > M^d). In round r every peer fails independently with probability p (it skips
the round and keeps its value and cell); survivors are bucketed by group_key(run, r, coords),
buckets bigger than M are split with split_bucket, and each group replaces its members' values by
the group mean. The metric is the mean squared distance to the mean of the initial values.

A restart stops once MSE <= target. JSON: rounds_to_target lists each restart's rounds (null if
it never got there within max_rounds); rounds_to_target_mean counts those as max_rounds (null if
no restart got there); mse_by_round[k] is the mean over restarts of the MSE after k rounds (index
0 = initial), a stopped restart's last MSE carried forward, up to the longest restart.

    python -m moshpitd.sim --peers 1024 --grid 32x32 --fail-prob 0.005 --restarts 20 --json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from moshpitd.matchmaking.grid import Grid, GridError, split_bucket

METHODS = ("moshpit", "random-groups", "allreduce-restart")
RUN = "sim"
IntArray = np.ndarray[Any, np.dtype[np.int64]]
FloatArray = np.ndarray[Any, np.dtype[np.float64]]


def place_peers(grid: Grid, peers: int, rng: np.random.Generator) -> IntArray:
    """Coordinates (peers x d): distinct random cells, or every cell k or k+1 times when N > M^d.

    Same distribution as the daemon's choose_coords (emptiest cell, ties at random), vectorized.
    """
    cells = grid.cells
    flat = np.concatenate([np.tile(np.arange(cells), peers // cells),
                           rng.choice(cells, peers % cells, replace=False)])
    rng.shuffle(flat)
    return np.stack(np.unravel_index(flat, (grid.size,) * grid.dims), axis=1).astype(np.int64)


def moshpit_groups(grid: Grid, round_: int, coords: IntArray, prng: random.Random) -> IntArray:
    """Group id per peer (rows of coords), from the daemon's own Grid.group_key and split_bucket.

    group_key is called once per distinct line (the key of a fixed round depends only on the line),
    and peers are bucketed by the key *strings*, so a key collision would show up here.
    """
    other = [k for k in range(grid.dims) if k != grid.axis(round_)]
    line_id = coords[:, other] @ (grid.size ** np.arange(len(other), dtype=np.int64))
    _, first, inverse = np.unique(line_id, return_index=True, return_inverse=True)
    keys = [grid.group_key(RUN, round_, tuple(int(v) for v in coords[i])) for i in first]
    bucket_of: dict[str, int] = {}
    for key in keys:
        bucket_of.setdefault(key, len(bucket_of))
    group: IntArray = np.array([bucket_of[k] for k in keys], dtype=np.int64)[inverse.ravel()]
    sizes = np.bincount(group)
    next_id = len(sizes)
    for b in np.flatnonzero(sizes > grid.size):
        members = [int(i).to_bytes(4, "little") for i in np.flatnonzero(group == b)]
        for part in split_bucket(members, grid.size, prng)[1:]:  # the first part keeps id b
            group[[int.from_bytes(m, "little") for m in part]] = next_id
            next_id += 1
    return group


def random_groups(n: int, size: int, rng: np.random.Generator) -> IntArray:
    """Baseline: a fresh random partition into max(1, n // size) groups as even as possible, so
    leftovers join full groups (as the paper's RandomGroupAverager does) rather than form a runt."""
    groups = max(1, n // size)
    return rng.permutation(n) % groups


def average_groups(x: FloatArray, who: IntArray, group: IntArray) -> None:
    """Replace x[who] by the mean of its group (equal weights), in place."""
    if len(who):
        sums = np.bincount(group, weights=x[who])
        x[who] = (sums / np.bincount(group))[group]


def run_restart(method: str, grid: Grid, peers: int, fail_prob: float, target: float,
                max_rounds: int, seed: int, restart: int) -> tuple[int | None, list[float]]:
    """One restart: (rounds to reach target or None, MSE after each round starting at 0)."""
    rng = np.random.default_rng([seed, restart])
    prng = random.Random(int(rng.integers(2**63)))
    x = rng.standard_normal(peers)
    coords = place_peers(grid, peers, rng)
    mu = float(x.mean())
    mse = [float(np.mean((x - mu) ** 2))]
    rounds = 0
    while mse[-1] > target and rounds < max_rounds:
        who = np.flatnonzero(rng.random(peers) >= fail_prob)
        if method == "moshpit":
            average_groups(x, who, moshpit_groups(grid, rounds, coords[who], prng))
        elif method == "random-groups":
            average_groups(x, who, random_groups(len(who), grid.size, rng))
        elif len(who) == peers:  # allreduce-restart: any failure aborts the whole round
            x[:] = x.mean()
        rounds += 1
        mse.append(float(np.mean((x - mu) ** 2)))
    return (rounds if mse[-1] <= target else None), mse


def simulate(peers: int, grid: Grid, fail_prob: float, restarts: int, target: float,
             max_rounds: int = 50, seed: int = 0, method: str = "moshpit") -> dict[str, Any]:
    """Run all restarts; unreached restarts count as max_rounds in rounds_to_target_mean."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    if peers < 1 or restarts < 1 or max_rounds < 0 or not 0.0 <= fail_prob < 1.0:
        raise ValueError("need peers >= 1, restarts >= 1, max_rounds >= 0, 0 <= fail_prob < 1")
    hits: list[int | None] = []
    curves: list[list[float]] = []
    for k in range(restarts):
        hit, curve = run_restart(method, grid, peers, fail_prob, target, max_rounds, seed, k)
        hits.append(hit)
        curves.append(curve)
    length = max(len(c) for c in curves)
    padded = np.array([c + [c[-1]] * (length - len(c)) for c in curves])
    reached = sum(h is not None for h in hits)
    counted = [max_rounds if h is None else h for h in hits]
    return {
        "method": method, "baseline": None if method == "moshpit" else method,
        "peers": peers, "grid": "x".join([str(grid.size)] * grid.dims), "fail_prob": fail_prob,
        "restarts": restarts, "target": target, "max_rounds": max_rounds, "seed": seed,
        "reached": reached,
        "rounds_to_target_mean": float(np.mean(counted)) if reached else None,
        "rounds_to_target": hits,
        "mse_by_round": [float(v) for v in padded.mean(axis=0)],
    }


def plot(results: Sequence[dict[str, Any]], path: str) -> None:
    """log10(MSE) by round for each method in one figure, like the paper's Figure 3 (left)."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = results[0]
    target = float(first["target"])
    floor = np.log10(target) - 3
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for res in results:
        mse = np.log10(np.maximum(np.asarray(res["mse_by_round"]), 1e-300))
        mean = res["rounds_to_target_mean"]
        label = f"{res['method']} ({res['reached']}/{res['restarts']} reached" + (
            f", {mean:.1f} rounds)" if mean is not None else ")")
        ax.plot(np.arange(len(mse)), np.maximum(mse, floor), marker="o", ms=3, label=label)
    ax.axhline(np.log10(target), color="gray", ls="--", lw=1, label=f"target {target:g}")
    ax.set_ylim(floor - 0.5, None)
    ax.set_xlabel("round")
    ax.set_ylabel("log10 MSE to the true mean")
    ax.set_title(f"{first['peers']} peers, grid {first['grid']}, fail prob {first['fail_prob']}, "
                 f"{first['restarts']} restarts")
    ax.legend(loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary(res: dict[str, Any]) -> str:
    mean = res["rounds_to_target_mean"]
    rounds = "never" if mean is None else f"mean {mean:.2f} rounds"
    return (f"{res['method']}: {res['peers']} peers, grid {res['grid']}, fail prob "
            f"{res['fail_prob']}: {res['reached']}/{res['restarts']} restarts reached MSE <= "
            f"{res['target']:g} ({rounds}; unreached count as {res['max_rounds']})")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moshpitd.sim", description=__doc__.split("\n")[0])
    ap.add_argument("--peers", type=int, default=1024)
    ap.add_argument("--grid", default="32x32", help="MxM[xM...]")
    ap.add_argument("--fail-prob", type=float, default=0.0)
    ap.add_argument("--restarts", type=int, default=20)
    ap.add_argument("--target", type=float, default=1e-9)
    ap.add_argument("--max-rounds", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline", choices=METHODS[1:], default=None)
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--plot", metavar="FILE.png", help="plot moshpit and both baselines")
    args = ap.parse_args(argv)
    try:
        grid = Grid.parse(args.grid)
    except GridError as exc:
        ap.error(str(exc))
    method = args.baseline or "moshpit"

    def run(m: str) -> dict[str, Any]:
        return simulate(args.peers, grid, args.fail_prob, args.restarts, args.target,
                        args.max_rounds, args.seed, m)

    try:
        res = run(method)
        others = [run(m) for m in METHODS if m != method] if args.plot else []
    except ValueError as exc:
        ap.error(str(exc))
    if args.plot:
        plot(sorted([res, *others], key=lambda r: METHODS.index(r["method"])), args.plot)
    if args.json:
        print(json.dumps(res))
    else:
        for r in [res, *others]:
            print(summary(r))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
