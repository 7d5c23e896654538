"""Averaging simulator (moshpitd.sim): the paper's 1024-peer, 32x32 experiment (arXiv 2103.03239,
§4.1) reproduced through the daemon's own grid keys, against random groups and all-reduce."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moshpitd import sim
from moshpitd.matchmaking.grid import Grid

GRID = Grid(32, 2)
RESTARTS = 200
# p: (the paper's mean rounds to MSE <= 1e-9 over 10 restarts, the paper's averaging code
# (averaging_experiments/averager.py, MoshpitAverager) re-run for 300 restarts: its expectation)
PAPER = {0.0: (2.0, 2.0), 0.001: (3.4, 3.62), 0.005: (4.8, 5.19), 0.01: (5.9, 5.87)}
_cache: dict[tuple[str, float], dict[str, Any]] = {}


def run(method: str, p: float, max_rounds: int = 50) -> dict[str, Any]:
    if (method, p) not in _cache:
        _cache[method, p] = sim.simulate(1024, GRID, p, RESTARTS, 1e-9, max_rounds=max_rounds,
                                         seed=0, method=method)
    return _cache[method, p]


@pytest.mark.parametrize("p", sorted(PAPER))
def test_moshpit_matches_paper(p: float) -> None:
    res = run("moshpit", p)
    paper, paper_code = PAPER[p]
    assert res["reached"] == RESTARTS
    assert abs(res["rounds_to_target_mean"] - paper) <= 0.5
    assert abs(res["rounds_to_target_mean"] - paper_code) <= 0.2


def test_full_grid_without_failures_takes_exactly_d_rounds() -> None:
    res = run("moshpit", 0.0)
    assert res["rounds_to_target"] == [2] * RESTARTS
    assert len(res["mse_by_round"]) == 3 and res["mse_by_round"][2] < 1e-25
    assert 0.8 < res["mse_by_round"][0] < 1.2  # N(0, 1) values


@pytest.mark.parametrize("p", sorted(PAPER))
def test_random_groups_are_slower(p: float) -> None:
    res = run("random-groups", p)
    assert res["reached"] == RESTARTS
    assert 5.0 <= res["rounds_to_target_mean"] <= 8.5  # measured: 6.2 / 6.3 / 6.6 / 7.0
    assert res["rounds_to_target_mean"] > run("moshpit", p)["rounds_to_target_mean"]


def test_allreduce_with_restarts() -> None:
    assert run("allreduce-restart", 0.0)["rounds_to_target"] == [1] * RESTARTS
    # 0.99^1024 ~ 3e-5: a round with no failure essentially never happens
    stuck = sim.simulate(1024, GRID, 0.01, 20, 1e-9, max_rounds=30, method="allreduce-restart")
    assert stuck["reached"] == 0 and stuck["rounds_to_target_mean"] is None
    assert all(0.5 < v < 2 for v in stuck["mse_by_round"]) and len(stuck["mse_by_round"]) == 31
    assert json.loads(json.dumps(stuck))["rounds_to_target_mean"] is None


@pytest.mark.parametrize("method", sim.METHODS)
def test_mse_never_increases_and_mean_is_kept(method: str) -> None:
    res = sim.simulate(300, Grid(8, 3), 0.05, 5, 1e-12, max_rounds=40, seed=4, method=method)
    mse = res["mse_by_round"]
    assert all(b <= a * (1 + 1e-12) for a, b in itertools.pairwise(mse))
    if method != "allreduce-restart":
        assert res["reached"] == 5 and mse[-1] <= 1e-12


def test_overfull_grid_uses_split_bucket() -> None:
    """2048 peers on 32x32: two per cell, so every line holds 64 peers and must be split."""
    grid = Grid(32, 2)
    rng = np.random.default_rng(1)
    coords = sim.place_peers(grid, 2048, rng)
    assert set(Counter(map(tuple, coords.tolist())).values()) == {2}
    groups = sim.moshpit_groups(grid, 7, coords, random.Random(1))
    keys = [grid.group_key(sim.RUN, 7, tuple(c)) for c in coords.tolist()]
    sizes = Counter(groups.tolist())
    assert set(sizes.values()) == {32} and len(sizes) == 64
    for g in sizes:  # a group never mixes keys
        assert len({keys[i] for i in np.flatnonzero(groups == g)}) == 1
    res = sim.simulate(2048, grid, 0.005, 5, 1e-9, seed=2)
    assert res["reached"] == 5 and res["rounds_to_target_mean"] <= 12


def test_place_peers() -> None:
    grid = Grid(4, 3)
    rng = np.random.default_rng(0)
    few = sim.place_peers(grid, 50, rng)
    assert len(set(map(tuple, few.tolist()))) == 50 and few.min() >= 0 and few.max() < 4
    many = Counter(map(tuple, sim.place_peers(grid, 150, rng).tolist()))
    assert len(many) == 64 and set(many.values()) == {2, 3}


def test_groups_follow_group_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulator buckets by the key strings: a key that ignores the line merges all lines."""
    coords = sim.place_peers(GRID, 1024, np.random.default_rng(0))
    assert len(set(sim.moshpit_groups(GRID, 0, coords, random.Random(0)).tolist())) == 32
    monkeypatch.setattr(Grid, "group_key", lambda self, run, r, c: f"{run}/{r}")
    merged = sim.moshpit_groups(GRID, 0, coords, random.Random(0))
    assert Counter(merged.tolist()).most_common(1)[0][1] == 32  # one bucket of 1024, split


def test_plot_without_matplotlib(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        sim.plot([run("moshpit", 0.0)], str(tmp_path / "x.png"))
    assert not (tmp_path / "x.png").exists()


def test_cli_json() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "moshpitd.sim", "--peers", "64", "--grid", "8x8", "--fail-prob",
         "0.01", "--restarts", "5", "--target", "1e-9", "--seed", "3", "--max-rounds", "30",
         "--json"],
        capture_output=True, text=True, check=True, timeout=60)
    res = json.loads(out.stdout)
    assert {k: res[k] for k in ("peers", "grid", "fail_prob", "restarts", "target", "baseline")} \
        == {"peers": 64, "grid": "8x8", "fail_prob": 0.01, "restarts": 5, "target": 1e-9,
            "baseline": None}
    assert res["reached"] == 5 and 2 <= res["rounds_to_target_mean"] <= 10
    assert res["mse_by_round"][-1] <= 1e-9 < res["mse_by_round"][0]
    assert len(res["mse_by_round"]) == max(res["rounds_to_target"]) + 1


def test_cli_rejects_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--grid", "8x4"], ["--fail-prob", "1.5"], ["--peers", "0"]):
        with pytest.raises(SystemExit) as exc:
            sim.main(argv)
        assert exc.value.code == 2
    assert sim.main(["--peers", "16", "--grid", "4x4", "--restarts", "2",
                     "--baseline", "random-groups"]) == 0
    assert "random-groups: 16 peers" in capsys.readouterr().out
