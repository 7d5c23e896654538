"""Helpers for integration tests: run blocking client calls side by side, wait for events."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch


def run_parallel(fns: list[Callable[[], Any]], timeout: float = 120.0) -> list[Any]:
    """Returns each call's result or the exception it raised, in order."""
    with ThreadPoolExecutor(len(fns)) as pool:
        futures = [pool.submit(fn) for fn in fns]
        out: list[Any] = []
        for f in futures:
            try:
                out.append(f.result(timeout))
            except Exception as exc:
                out.append(exc)
        return out


def scrape(daemon: Any) -> dict[str, float]:
    """A daemon's /metrics: each sample by its name with labels, as Prometheus prints it."""
    with urllib.request.urlopen(f"http://{daemon.info['metrics']}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r"^([^#\s]\S*) (\S+)$", text, re.MULTILINE)}


def wait_until(cond: Callable[[], Any], timeout: float, what: str, poll: float = 0.01) -> Any:
    """Polls `cond` until it returns something true, and returns that; fails naming `what`
    after `timeout` seconds. A test waits on the event it needs, never on a fixed sleep."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(poll)


def active_keys(client: Any) -> list[str]:
    """The keys the client's daemon is matchmaking under now (its status over IPC)."""
    return list(client.status()["status"]["active_keys"])


def weighted_mean(arrays: list[np.ndarray], weights: list[float]) -> np.ndarray:
    stacked = np.stack([a.astype(np.float64) for a in arrays])
    w = np.asarray(weights, dtype=np.float64).reshape(-1, *([1] * (stacked.ndim - 1)))
    return (stacked * w).sum(0) / w.sum()


def assert_close_to_mean(result: torch.Tensor, inputs: list[torch.Tensor],
                         weights: list[float]) -> None:
    """Within 1e-6 relative for float32 (1e-12 float64, 1e-3 float16), measured against the
    mean's scale so that elements whose mean is near zero do not need exact cancellation."""
    expected = weighted_mean([t.numpy() for t in inputs], weights)
    rtol = {torch.float16: 1e-3, torch.float32: 1e-6, torch.float64: 1e-12}[result.dtype]
    got = result.numpy().astype(np.float64)
    scale = np.abs(np.stack([t.numpy().astype(np.float64) for t in inputs])).max(0)
    assert result.shape == inputs[0].shape and result.dtype == inputs[0].dtype
    err = np.abs(got - expected)
    bad = err > rtol * np.maximum(scale, np.abs(expected)) + 1e-30
    assert not bad.any(), (
        f"{bad.sum()} of {bad.size} elements off; worst {err.max():.3g} at "
        f"{np.unravel_index(err.argmax(), err.shape)}"
    )


REPO = Path(__file__).resolve().parents[2]


def run_swarm_smoke(out: Path, *args: str) -> tuple[dict[str, Any], str]:
    """`python -m bench.swarm --smoke --json` with `args`, writing to `out`: its JSON results
    and its stderr (the run must exit 0)."""
    proc = subprocess.run([sys.executable, "-m", "bench.swarm", "--smoke", "--json",
                           "--out", str(out), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


# Trainer processes run niced: `make test` runs several files at once on few cores, and a
# CPU-bound training step can wait where a daemon's round, or a test waiting on a socket,
# should not. A trainer only steps a little slower.
NICE = ["nice", "-n", "10"]
