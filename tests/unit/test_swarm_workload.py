"""bench.swarm's workload and worker spec: the fixed split, the model, evaluation, the spec."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.swarm import corpus as corpus_mod
from bench.swarm.corpus import CorpusNotFound, is_validation, load_corpus, unigram_entropy
from bench.swarm.worker import SpecError, WorkerSpec, wait_for_file
from bench.swarm.workload import (
    Batches,
    Hyper,
    build_model,
    count_parameters,
    evaluate,
    lm_loss,
    make_optimizer,
    model_config,
    validation_windows,
)


def _real_corpus() -> corpus_mod.Corpus:
    try:
        return load_corpus()
    except CorpusNotFound as exc:
        pytest.skip(f"no corpus: {exc}")


def _fake_sources(root: Path, files: int = 40) -> Path:
    for i in range(files):
        sub = root / f"dir{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"page{i}.rst.txt").write_bytes(f"Page {i}\n{'=' * 7}\n\ntext {i} ".encode() * 5)
    (root / "ignored.html").write_text("not a source")
    return root


def test_split_is_by_file_disjoint_complete_and_fixed(tmp_path: Path) -> None:
    root = _fake_sources(tmp_path / "src")
    first = load_corpus(root)
    names = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.rst.txt"))
    assert not set(first.train_files) & set(first.validation_files)
    assert sorted(first.train_files + first.validation_files) == names
    assert all(is_validation(n) for n in first.validation_files)
    assert not any(is_validation(n) for n in first.train_files)
    load_corpus.cache_clear()
    again = load_corpus(root)
    assert again.validation_files == first.validation_files
    assert np.array_equal(again.train, first.train)
    assert len(first.train) + len(first.validation) == sum(
        (root / n).stat().st_size for n in names)


def test_missing_sources_name_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpus_mod, "SOURCES_GLOB", str(tmp_path / "nothing*"))
    monkeypatch.delenv(corpus_mod.ENV_DIR, raising=False)
    with pytest.raises(CorpusNotFound, match="python3-doc"):
        corpus_mod.find_sources()


def test_real_corpus_split_is_mostly_training() -> None:
    corpus = _real_corpus()
    assert 0.03 < len(corpus.validation) / len(corpus.train) < 0.3
    assert not set(corpus.train_files) & set(corpus.validation_files)


def test_unigram_entropy_bounds() -> None:
    assert unigram_entropy(np.zeros(100, dtype=np.uint8)) == 0.0
    uniform = np.arange(256 * 4, dtype=np.int64).astype(np.uint8)
    assert unigram_entropy(uniform) == pytest.approx(math.log(256))
    text = _real_corpus().train
    assert 2.0 < unigram_entropy(text) < math.log(256)


def test_model_sizes_and_seeded_init() -> None:
    small = count_parameters(build_model("small"))
    assert 1_000_000 <= small <= 5_000_000
    assert count_parameters(build_model("tiny")) < small / 4
    a, b, c = build_model("tiny", seed=0), build_model("tiny", seed=0), build_model("tiny", 1)
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(),
                                  c.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
        if pa.dim() >= 2:
            assert not torch.equal(pa, pc), name
    with pytest.raises(ValueError, match="unknown model"):
        model_config("huge")


def test_batches_depend_on_seed_host_and_start() -> None:
    _real_corpus()
    one = Batches(4, 64, seed=0, host=1).next()
    assert one.shape == (4, 65) and one.dtype == torch.int64
    assert torch.equal(one, Batches(4, 64, seed=0, host=1).next())
    assert not torch.equal(one, Batches(4, 64, seed=0, host=2).next())
    assert not torch.equal(one, Batches(4, 64, seed=0, host=1, start=32).next())


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One thread, as the workers run: two OpenMP threads on a busy machine spin for ages."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("one_thread")
def test_evaluate_is_deterministic_and_a_few_steps_lower_the_loss() -> None:
    _real_corpus()
    model = build_model("tiny", seed=0)
    before = evaluate(model.state_dict(), model="tiny")
    assert before == evaluate(model.state_dict(), model="tiny")
    assert torch.equal(validation_windows("tiny"), validation_windows("tiny"))
    assert validation_windows("tiny").shape[1] == model_config("tiny").context + 1
    opt = make_optimizer(model, Hyper(lr=3e-3))
    batches = Batches(8, 64, seed=0)
    for _ in range(30):
        opt.zero_grad()
        lm_loss(model, batches.next()).backward()
        opt.step()
    after = evaluate(model.state_dict(), model="tiny")
    assert after < before - 0.5, (before, after)


def _spec(tmp_path: Path, **changes: object) -> dict[str, object]:
    raw: dict[str, object] = {
        "system": "moshpit", "host": 1, "hosts": 2, "host_ips": ["10.0.0.1", "10.0.0.2"],
        "port_base": 7710, "seed": 0, "model": "tiny", "batch": 8, "seq_len": 64, "lr": 1e-3,
        "weight_decay": 0.1, "budget_s": 30.0, "start_at": None,
        "start_file": str(tmp_path / "start"), "out_dir": str(tmp_path / "out"),
        "shared_dir": str(tmp_path), "snapshot_every_s": 6.0, "ipc_socket": "/tmp/x.sock",
        "knobs": {"tau": 3}}
    raw.update(changes)
    return raw


def test_worker_spec_parses_and_refuses_bad_input(tmp_path: Path) -> None:
    spec = WorkerSpec.from_dict(_spec(tmp_path))
    assert spec.ip == "10.0.0.2" and spec.knob("tau", 5) == 3 and spec.start_at is None
    assert json.loads(json.dumps(_spec(tmp_path)))  # what the orchestrator writes is JSON
    cases: list[tuple[dict[str, object], str]] = [
        ({"system": "gossip"}, "not one of"), ({"seq_len": 32}, "context"),
        ({"host": 2}, "host 2 of 2"), ({"ipc_socket": None}, "ipc_socket"),
        ({"start_file": None}, "start_at or start_file"), ({"batch": "eight"}, "bad worker spec"),
        ({"system": "ddp"}, "ddp.world")]
    for bad, match in cases:
        with pytest.raises(SpecError, match=match):
            WorkerSpec.from_dict(_spec(tmp_path, **bad))


def test_start_file_is_read_once_complete(tmp_path: Path) -> None:
    path = tmp_path / "start"
    with pytest.raises(TimeoutError, match="no start time"):
        wait_for_file(path, poll_s=0.01, timeout_s=0.05)
    path.write_text("1795559000.25\n")
    assert wait_for_file(path) == 1795559000.25
