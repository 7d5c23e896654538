"""bench.swarm's end rule: every row is scored on the mean of its hosts' models at the deadline,
on a held-out set of disjoint windows that is the same for every row; a seed changes the data
order, never the initial weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bench.swarm import evaluation
from bench.swarm.corpus import CorpusNotFound, load_corpus
from bench.swarm.workload import (
    HELD_OUT_WINDOWS,
    MODEL_SEED,
    Batches,
    build_model,
    evaluate,
    held_out_set,
    held_out_windows,
    mean_state,
)


def test_held_out_windows_are_disjoint_fixed_and_sized() -> None:
    data = np.random.default_rng(0).integers(0, 256, size=65 * 100 + 30).astype(np.uint8)
    windows = held_out_windows(data, 64, count=40)
    assert windows.shape == (40, 65)
    assert np.array_equal(windows, held_out_windows(data, 64, count=40))
    tiles = data[: 65 * 100].reshape(100, 65)
    which = [int(np.flatnonzero(np.all(tiles == w, axis=1))[0]) for w in windows]
    assert which == sorted(which) and len(set(which)) == 40  # whole tiles, none twice
    assert not np.array_equal(windows, held_out_windows(data, 64, count=40, seed=1))
    with pytest.raises(ValueError, match="hold 100 windows of 65, not 101"):
        held_out_windows(data, 64, count=101)
    assert HELD_OUT_WINDOWS * 64 >= 256 * 1024


def test_the_real_held_out_set_is_256_kb_of_validation_text() -> None:
    try:
        corpus = load_corpus()
    except CorpusNotFound as exc:
        pytest.skip(f"no corpus: {exc}")
    windows = held_out_set("small")
    assert windows.shape == (HELD_OUT_WINDOWS, 65) and windows.dtype == torch.int64
    assert windows.shape[0] * 64 >= 256 * 1024
    assert torch.equal(windows[:8], held_out_set("tiny")[:8])  # same context: same bytes
    head = bytes(windows[0].to(torch.uint8).tolist())
    assert head in corpus.validation.tobytes() and head not in corpus.train.tobytes()


def test_a_seed_changes_the_data_not_the_weights() -> None:
    try:
        load_corpus()
    except CorpusNotFound as exc:
        pytest.skip(f"no corpus: {exc}")
    a, b = Batches(4, 64, seed=0, host=1).next(), Batches(4, 64, seed=1, host=1).next()
    assert not torch.equal(a, b)
    assert MODEL_SEED == 0  # the worker builds every run's model from it, whatever the seed


def test_mean_state_is_the_exact_mean() -> None:
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor([3])}
    b = {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor([7])}
    out = mean_state([a, b])
    assert torch.equal(out["w"], torch.tensor([2.0, 4.0])) and out["w"].dtype == torch.float32
    assert torch.equal(out["n"], torch.tensor([3]))  # not floating: the first host's
    with pytest.raises(ValueError, match="no state"):
        mean_state([])


def _worker(host: int, events: list[dict[str, Any]], ddp: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {"ddp": {"world": [0, 1]}} if ddp else {}
    return {"host": host, "gen": 0, "spec": spec, "killed_at": None, "events": events}


def _record(system: str, ddp: bool = False, seed: int = 2) -> dict[str, Any]:
    workers = [_worker(h, [{"event": "snapshot", "path": f"s{h}", "t": 1.0},
                           {"event": "budget", "path": f"b{h}", "t": 2.0},
                           {"event": "done", "path": f"d{h}", "t": 3.0}], ddp)
               for h in range(2)]
    return {"scenario": "wan", "system": system, "seed": seed,
            "config": {"model": "tiny", "held_out_windows": 512, "seed": seed},
            "workers": workers}


def test_jobs_score_each_runs_mean_end_model_on_the_held_out_set() -> None:
    jobs = {j.key: j for j in evaluation.jobs_for([_record("hivemind-local"),
                                                   _record("ddp", ddp=True, seed=0)])}
    end = jobs["end:wan/hivemind-local/seed2"]
    assert (end.paths, end.held_out) == (("b0", "b1"), 512)  # both hosts, before any sync
    assert jobs["end:wan/ddp/seed0"].paths == ("b0",)  # one model: rank 0's
    assert {"s0", "s1", "b0", "b1"} <= set(jobs)  # curve points, on the validation windows
    assert jobs["s1"].held_out == 0 and "d0" not in jobs  # done models are not scored
    assert jobs["initial:tiny"].paths == () and jobs["initial:tiny"].held_out == 0
    assert jobs[evaluation.held_out_key("tiny", 512)].held_out == 512
    assert next(iter(jobs.values())).held_out == 512  # the long jobs first


def test_score_of_a_mean_of_identical_models_is_that_models(tmp_path: Path) -> None:
    try:
        load_corpus()
    except CorpusNotFound as exc:
        pytest.skip(f"no corpus: {exc}")
    torch.set_num_threads(1)
    state = build_model("tiny", MODEL_SEED).state_dict()
    paths = []
    for name in ("a.pt", "b.pt"):
        torch.save(state, tmp_path / name)
        paths.append(str(tmp_path / name))
    one = evaluation.score(evaluation.Job("x", (paths[0],), "tiny", 64))
    two = evaluation.score(evaluation.Job("y", tuple(paths), "tiny", 64))
    assert one == pytest.approx(two, abs=1e-6)
    assert one == pytest.approx(evaluate(state, "tiny", held_out_set("tiny", 64)))
    missing = evaluation.score(evaluation.Job("z", (str(tmp_path / "gone.pt"),), "tiny", 64))
    assert missing != missing  # NaN, not an exception
