"""64 daemons (MoshpitNode, unchanged) in one process on moshpitd/virtual's loop and network:
internet round trips cost virtual time only, so these run in seconds."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from moshpitd.matchmaking.grid import Grid
from moshpitd.rounds import AverageResult
from moshpitd.virtual import loop as vloop
from moshpitd.virtual.net import Link, Network
from moshpitd.virtual.swarm import Peer, Swarm

REPO = Path(__file__).resolve().parents[2]
GRID = Grid(8, 2)
LINK = Link(delay=0.02, up=50e6 / 8, down=200e6 / 8)  # 80 ms round trips, no loss


async def grid_swarm(elems: int = 256) -> tuple[Swarm, np.ndarray[Any, Any]]:
    net = Network(asyncio.get_running_loop(), seed=3)  # type: ignore[arg-type]
    swarm = Swarm(net, elems)
    vectors = np.random.default_rng(3).standard_normal((GRID.cells, elems)).astype(np.float32)
    for v in vectors:
        await swarm.add(LINK, v)
    return swarm, vectors.astype(np.float64).mean(0)


async def one_round(swarm: Swarm, peers: list[Peer]) -> list[Any]:
    cells = list(GRID.all_cells())
    await asyncio.gather(*(swarm.average(p, "run", 30.0, grid=GRID,
                                         initial_coords=cells[p.index]) for p in peers))
    return [p.results[-1] for p in peers]


def test_a_full_grid_holds_the_exact_mean_after_two_rounds() -> None:
    async def main() -> tuple[list[float], list[Counter[int]], list[float], float]:
        swarm, mean = await grid_swarm()
        sizes, datagrams, errors = [], [], []
        for _ in range(3):
            before = sum(p.host.sent["datagrams"] for p in swarm.peers)
            results = await one_round(swarm, swarm.peers)
            assert all(isinstance(r, AverageResult) for r in results), results
            sizes.append(Counter(r.rounds[-1].group_size for r in results))
            datagrams.append((sum(p.host.sent["datagrams"] for p in swarm.peers) - before)
                             / len(swarm.peers))
            errors.append(max(float(np.max(np.abs(p.vector - mean))) for p in swarm.peers))
        now = swarm.net.loop.time()
        await swarm.stop()
        return errors, sizes, datagrams, now
    errors, sizes, datagrams, virtual = vloop.run(main)
    assert sizes == [Counter({8: 64})] * 3  # every line a full group, every round
    assert errors[0] > 0.1 and max(errors[1:]) < 1e-5, errors  # d = 2 rounds: the exact mean
    # per peer and round, once joined: its lines' records, not the run's
    assert max(datagrams[1:]) < 70, datagrams
    assert virtual < 60, virtual


def test_a_killed_peers_line_mates_average_without_it() -> None:
    """Peer 9 dies (its process: connections reset, nothing withdrawn) after the first
    round. In the second, its line-mates of axis 1 form their group without it, within the
    round's deadlines, and nobody fails. (Another line's peer sometimes ends that round alone:
    docs/scale.md, "Findings".)"""
    async def main() -> tuple[list[Peer], list[Any], float]:
        swarm, _ = await grid_swarm()
        await one_round(swarm, swarm.peers)
        victim = swarm.peers[9]
        await swarm.leave(victim)
        start = swarm.net.loop.time()
        results = await one_round(swarm, swarm.peers)
        took = swarm.net.loop.time() - start
        await swarm.stop()
        return swarm.peers, results, took
    peers, results, took = vloop.run(main)
    assert all(isinstance(r, AverageResult) for r in results), results
    mates = [r.rounds[-1] for p, r in zip(peers, results, strict=True) if 8 <= p.index < 16]
    assert [(m.group_size, m.result) for m in mates] == [(7, "ok")] * 7, mates
    others = Counter(r.rounds[-1].result for p, r in zip(peers, results, strict=True)
                     if not 8 <= p.index < 16)
    assert set(others) <= {"ok", "alone"} and others["ok"] >= 55, others
    assert took < 30, took


def test_bench_internet_reports_every_round(tmp_path: Path) -> None:
    """The long benchmark's smoke: 16 peers, 3 rounds, its JSON and plot."""
    plot = tmp_path / "convergence.png"
    proc = subprocess.run([sys.executable, "-m", "bench.internet", "--peers", "16", "--rounds",
                           "3", "--delay", "const:5", "--loss", "const:0", "--json",
                           "--plot", str(plot)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["grid"] == [4, 2] and out["filled"] and len(out["rounds"]) == 3
    first, *rest = out["rounds"]
    assert first["mse_to_mean"] > 1.0 and all(r["mse_to_mean"] < 1e-9 for r in rest[1:]), out
    assert all(r["dht_datagrams_per_peer"] > 0 and r["virtual_s"] > 0 for r in out["rounds"])
    assert out["off_mean"] == [] and plot.stat().st_size > 0
