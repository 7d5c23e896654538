"""bench.swarm's worker in a real process: the start file, events, checkpoint and resume.

A DDP world of one on loopback (gloo, a real TCP store) exercises everything the
orchestrator relies on without namespaces: `ready` before the start, the start read from a
file written after it, progress, snapshots, a checkpoint in shared_dir, the model at the
deadline (`budget`), `done` with a final snapshot that evaluates; then a second worker, of the
ddp-fp16 row (fp16_compress_hook), resumes from that checkpoint and counts its samples from
the checkpoint's value.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.swarm.corpus import CorpusNotFound, load_corpus
from bench.swarm.workload import evaluate

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _corpus() -> None:
    try:
        load_corpus()
    except CorpusNotFound as exc:
        pytest.skip(f"no corpus: {exc}")


def _spec(tmp: Path, resume: str | None, budget: float, system: str) -> Path:
    spec = {"system": system, "host": 0, "hosts": 1, "host_ips": ["127.0.0.1"],
            "port_base": 0, "seed": 0, "model": "tiny", "batch": 4, "seq_len": 64,
            "lr": 1e-3, "weight_decay": 0.1, "budget_s": budget, "start_at": None,
            "start_file": str(tmp / "start"), "out_dir": str(tmp / "out"),
            "shared_dir": str(tmp.parent / "shared"), "snapshot_every_s": 0.5,
            "ddp": {"world": [0], "generation": 0 if resume is None else 1,
                    # a world of one: its store binds a port of its own (a port picked free
                    # here was once taken by another test's daemon before the worker bound it)
                    "master": "127.0.0.1:0", "resume": resume,
                    "checkpoint_every_s": 1.0},
            "knobs": {}}
    tmp.mkdir(parents=True)
    path = tmp / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def _run(tmp: Path, resume: str | None = None, budget: float = 4.0, system: str = "ddp"
         ) -> list[dict[str, Any]]:
    """Runs one worker; writes the start file (atomically) once it said ready."""
    spec = _spec(tmp, resume, budget, system)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "bench.swarm.worker", "--spec", str(spec)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
                            stderr=(tmp / "worker.log").open("w"))
    events: list[dict[str, Any]] = []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            event = json.loads(line)
            events.append(event)
            if event["event"] == "ready":
                assert not (tmp / "start").exists()
                part = tmp / "start.tmp"
                part.write_text(f"{time.time() + 0.2}\n")
                os.replace(part, tmp / "start")
        assert proc.wait(timeout=120) == 0, (tmp / "worker.log").read_text()[-3000:]
    finally:
        proc.kill()
    return events


def _kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["event"] for e in events]


def test_ddp_worker_events_checkpoint_and_resume(tmp_path: Path) -> None:
    first = _run(tmp_path / "g0")
    kinds = _kinds(first)
    assert kinds[0] == "ready" and kinds[-1] == "done", kinds
    assert {"progress", "sync", "snapshot", "checkpoint"} <= set(kinds), kinds
    assert all(isinstance(e["t"], float) for e in first)
    start = float((tmp_path / "g0" / "start").read_text())
    done = first[-1]
    assert done["t"] >= start + 4.0  # trained the whole budget from the start in the file
    assert done["samples"] == 4 * done["step"] > 0
    final = torch.load(done["path"], map_location="cpu")
    assert math.isfinite(evaluate(final, model="tiny"))

    ckpt = next(e for e in reversed(first) if e["event"] == "checkpoint")
    assert Path(ckpt["path"]).parent == tmp_path / "shared"
    assert ckpt["samples_by_host"] == {"0": ckpt["samples"]}
    budget = next(e for e in first if e["event"] == "budget")
    assert budget["step"] == done["step"] and 0.0 <= budget["late_s"] < 2.0
    # the resumed world is the fp16 row: the same checkpoint, gradients all-reduced in float16
    resumed = _run(tmp_path / "g1", resume=ckpt["path"], budget=1.0, system="ddp-fp16")
    ready = resumed[0]
    assert ready["event"] == "ready"
    assert (ready["step"], ready["samples"]) == (ckpt["step"], ckpt["samples"])
    assert resumed[-1]["event"] == "done" and resumed[-1]["step"] > ckpt["step"]
    assert any(e["event"] == "sync" and e["ok"] for e in resumed)
