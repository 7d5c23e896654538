"""`python -m bench.diloco --smoke` end to end: two DiLoCo trainers, each a process with its own
moshpitd on loopback, and the one-process baseline, on the tiny model for 20 steps with H = 10.

Asserts what a broken benchmark would not produce: every trainer completed both outer steps
with the whole swarm and no failed round; the trainers' final models are identical (after an
outer step every trainer holds the same global copy: the span owners send every member the
same compressed mean, and each trainer compresses its own span's mean alike); the losses are
finite and below the untrained model's; the bytes counted are the fp16 pseudo-gradients'; the
table is printed.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.diloco.report import ddp_bytes
from bench.swarm.corpus import CorpusNotFound, load_corpus

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(180)


def test_smoke_trains_two_trainers_against_the_baseline() -> None:
    try:
        load_corpus()
    except CorpusNotFound as exc:
        pytest.skip(f"no corpus: {exc}")
    proc = subprocess.run([sys.executable, "-m", "bench.diloco", "--smoke", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-6000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    cfg = results["config"]
    assert (cfg["trainers"], cfg["steps"], cfg["every"], cfg["codec"]) == (2, 20, [10], "fp16")
    [run] = results["runs"]
    assert run["completed"], run
    assert run["outer_steps"] == [2, 2] and run["failed"] == [0, 0], run
    assert run["groups"] == [{"2": 2}, {"2": 2}], run  # both outer steps with the whole swarm
    assert run["max_abs_diff"] == 0.0, run
    initial = results["initial_loss"]
    for loss in (run["val_loss"], results["baseline"]["val_loss"]):
        assert math.isfinite(loss) and loss < initial - 0.5, (loss, initial)
    # two fp16 rounds: each trainer sends half its vector to the other's span and its own
    # span's mean back, so about 2 x 2 bytes x P over the run (plus alignment of parts)
    params = cfg["parameters"]
    for sent in run["sent_bytes"]:
        assert 2 * 2 * params <= sent <= 1.05 * 2 * 2 * params, (sent, params)
    assert run["ddp_bytes_per_trainer"] == ddp_bytes(params, 2, 20) == 20 * 4 * params
    assert "| DiLoCo H=10 |" in proc.stderr and "| baseline, batch 16 |" in proc.stderr
    assert "DDP sends 2 (n - 1) / n x 4 P bytes" in proc.stderr
