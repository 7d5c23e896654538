"""Moshpit SGD end to end: 4 trainer processes, each with its own real daemon, on sklearn digits.

Trainers run `sys.executable -c TRAINER` (never forked: torch threads and sockets do not survive
fork). Each holds a quarter of the training split, starts from the same seeded weights and
averages every few local steps; the reference is one process on all the data with a 4x batch
for the same epochs, so both take the same number of steps over the same samples.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from moshpitd.launcher import LocalSwarm
from tests.integration.helpers import NICE

WORLD = 4
BATCH = 16  # per trainer; the single process uses WORLD * BATCH
EPOCHS = 12
LR = 3e-3
EVERY = 4
COMPUTE = 0.005  # seconds of simulated compute per step (a sleep: it leaves the cores free)

TRAINER = r'''
import json, sys, time
import numpy as np
import torch
from torch import nn

import moshpit

cfg = json.loads(sys.argv[1])
torch.set_num_threads(1)  # 4 trainers and 4 daemons share two cores
rank, world = cfg["rank"], cfg["world"]
with np.load(cfg["data"]) as d:
    per_rank = len(d["x_train"]) // world
    x = torch.from_numpy(d["x_train"][rank::world][:per_rank])
    y = torch.from_numpy(d["y_train"][rank::world][:per_rank]).long()
    x_test, y_test = torch.from_numpy(d["x_test"]), torch.from_numpy(d["y_test"]).long()

torch.manual_seed(0)  # the same initial weights on every rank
model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))
inner = torch.optim.Adam(model.parameters(), lr=cfg["lr"])
checks = {"applied": 0, "bad": 0}


class RecordingClient(moshpit.Client):
    """Remembers, at the moment average() returns, what it returned and what it was given."""

    def average(self, tensors, *args, **kwargs):
        self.sent = [t.clone() for t in tensors]
        out = super().average(tensors, *args, **kwargs)
        self.returned = [t.clone() for t in out]
        return out


class CheckedOptimizer(moshpit.Optimizer):
    """Checks every applied delta: snapshot is what was sent, averaged is exactly what the
    round returned (nothing written after), and each tensor moved by averaged - snapshot.
    Logs what each step did: "L" started a round in the background, "S" settled one (blocking:
    ran it; overlap: applied or failed the one in flight), "B" both, "." neither."""

    schedule = ""

    def step(self, *args, **kwargs):
        pending, ended = self._pending, self.rounds_done + self.failed_rounds
        out = super().step(*args, **kwargs)
        settled = self.rounds_done + self.failed_rounds > ended
        launched = self._pending is not None and self._pending is not pending
        self.schedule += "B" if settled and launched else "S" if settled else (
            "L" if launched else ".")
        return out

    def _apply_delta(self, tensors, snapshot, averaged, names):
        before = [t.detach().clone() for t in tensors]
        ok = all(torch.equal(a, r) for a, r in zip(averaged, self.client.returned))
        ok &= all(torch.equal(s, w) for s, w in zip(snapshot, self.client.sent))
        super()._apply_delta(tensors, snapshot, averaged, names)
        for t, b, s, a, n in zip(tensors, before, snapshot, averaged, names):
            want = b + (a - s)
            if moshpit.optimizer.stays_non_negative(n):
                want = want.clamp(min=0)
            ok &= torch.equal(t.detach(), want)
        checks["applied"] += 1
        checks["bad"] += 0 if ok else 1


if cfg["solo"]:
    opt = None
else:
    opt = CheckedOptimizer(
        inner, client=RecordingClient(cfg["socket"]), key=cfg["key"],
        average_every=cfg["every"], group_size=world, model=model, average_state=True,
        overlap=cfg["overlap"], timeout=20.0)
    assert opt.sync(min_group_size=world), opt.last_error  # start together
loss_fn = nn.CrossEntropyLoss()
gen = torch.Generator().manual_seed(1000 + rank)
start = time.monotonic()
for epoch in range(cfg["epochs"]):
    model.train()
    order = torch.randperm(len(x), generator=gen)
    for i in range(0, len(x) - cfg["batch"] + 1, cfg["batch"]):  # full batches only
        idx = order[i:i + cfg["batch"]]
        loss = loss_fn(model(x[idx]), y[idx])
        inner.zero_grad()
        loss.backward()
        if opt is None:
            inner.step()
        else:
            time.sleep(cfg["compute"])  # a bigger model's backward: what overlap hides rounds in
            opt.step(batch_size=len(idx))
final_sync = None
if opt is not None:
    final_sync = opt.sync(min_group_size=world)  # end together: one model everywhere
model.eval()
with torch.no_grad():
    acc = float((model(x_test).argmax(1) == y_test).float().mean())
    digest = float(sum(p.double().sum() for p in model.parameters()))
print(json.dumps({
    "rank": rank, "accuracy": acc, "digest": digest, "seconds": time.monotonic() - start,
    "final_sync": final_sync, "local_step": None if opt is None else opt.local_step,
    "rounds_done": None if opt is None else opt.rounds_done,
    "failed_rounds": None if opt is None else opt.failed_rounds,
    "group_size": None if opt is None or opt.last_round is None else opt.last_round.group_size,
    "schedule": None if opt is None else opt.schedule, "checks": checks}), flush=True)
'''


def save_split(path: Path) -> None:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=0, stratify=y)
    np.savez(path, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)


def spawn(cfg: dict[str, Any]) -> subprocess.Popen[str]:
    return subprocess.Popen([*NICE, sys.executable, "-c", TRAINER, json.dumps(cfg)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def collect(procs: list[subprocess.Popen[str]], timeout: float = 240.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(deadline - time.monotonic(), 1.0))
            assert p.returncode == 0, f"trainer exited with {p.returncode}:\n{err[-3000:]}"
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


@pytest.fixture(scope="module")
def setting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One swarm and one data split for the module; each run uses its own key."""
    tmp = tmp_path_factory.mktemp("optimizer")
    data = tmp / "digits.npz"
    save_split(data)
    swarm = LocalSwarm(WORLD, workdir=tmp / "swarm").start()
    try:
        yield {"swarm": swarm, "data": str(data), "runs": {}}
    finally:
        swarm.stop()


def train(setting: dict[str, Any], overlap: bool) -> list[dict[str, Any]]:
    """Runs the 4 trainers once per mode (cached: the overlap test compares with blocking)."""
    runs = setting["runs"]
    if overlap not in runs:
        swarm: LocalSwarm = setting["swarm"]
        base = {"world": WORLD, "data": setting["data"], "epochs": EPOCHS, "batch": BATCH,
                "lr": LR, "every": EVERY, "overlap": overlap, "solo": False, "compute": COMPUTE,
                "key": f"digits-{'overlap' if overlap else 'blocking'}"}
        start = time.monotonic()
        results = collect([spawn({**base, "rank": r, "socket": swarm.sockets[r]})
                           for r in range(WORLD)])
        print(f"{'overlap' if overlap else 'blocking'}: {time.monotonic() - start:.1f} s",
              [(r["accuracy"], r["rounds_done"], r["failed_rounds"], round(r["seconds"], 1))
               for r in results], [r["schedule"] for r in results])
        runs[overlap] = results
    return list(runs[overlap])


def check_schedule(schedule: str, overlap: bool) -> int:
    """Every round started exactly when the optimizer's rule says, and settled once; returns
    how many started. Blocking: one every EVERY steps. Overlap: at the first step at least
    EVERY steps after the last start with no round in flight (a round still in flight delays
    the next one; two never run at once, and none is skipped once due)."""
    last, pending = 0, False  # the opening sync started the count at step 0
    for step, what in enumerate(schedule, start=1):
        if not overlap:
            assert (what == "S") == (step % EVERY == 0), (step, schedule)
            continue
        settled, launched = what in "SB", what in "LB"
        assert pending or not settled, (step, schedule)
        pending &= not settled
        assert launched == (not pending and step - last >= EVERY), (step, schedule)
        if launched:
            last, pending = step, True
    return sum(what in ("LB" if overlap else "S") for what in schedule)


def check_trainers(results: list[dict[str, Any]], overlap: bool, min_success: float) -> None:
    steps = results[0]["local_step"]
    for r in results:
        assert r["final_sync"] is True, r
        assert r["group_size"] == WORLD, r
        assert r["local_step"] == steps == len(r["schedule"]), r
        started = check_schedule(r["schedule"], overlap)
        # each round started settled once (overlap: the last in flight at the closing sync),
        # and the two syncs; most of them averaged
        assert r["rounds_done"] + r["failed_rounds"] == started + 2, r
        assert r["rounds_done"] >= min_success * (started + 2), r
    # the final round with everyone leaves one model on every rank
    digests = [r["digest"] for r in results]
    assert max(digests) - min(digests) <= 1e-4 * max(1.0, abs(digests[0])), digests
    accs = [r["accuracy"] for r in results]
    assert max(accs) - min(accs) <= 1e-9, accs


def test_moshpit_sgd_matches_single_process_accuracy(setting: dict[str, Any]) -> None:
    solo = spawn({"world": 1, "rank": 0, "data": setting["data"], "epochs": EPOCHS,
                  "batch": WORLD * BATCH, "lr": LR, "every": EVERY, "overlap": False,
                  "solo": True, "key": "", "socket": ""})
    try:
        results = train(setting, overlap=False)
    finally:
        (reference,) = collect([solo])
    # a round every EVERY steps: a few may fail, most must succeed
    check_trainers(results, overlap=False, min_success=0.8)
    moshpit_acc, solo_acc = results[0]["accuracy"], reference["accuracy"]
    print(f"moshpit {moshpit_acc:.4f} vs single process {solo_acc:.4f}")
    assert solo_acc > 0.9, reference  # the setting itself learns
    assert abs(moshpit_acc - solo_acc) <= 0.01, (moshpit_acc, solo_acc)


def test_overlap_converges_like_blocking_and_applies_whole_results(
        setting: dict[str, Any]) -> None:
    overlapped = train(setting, overlap=True)
    blocking = train(setting, overlap=False)
    # a round still in flight when the next is due delays it (fewer rounds than blocking, at
    # the steps check_schedule derives); of those started, most must average, as in blocking
    check_trainers(overlapped, overlap=True, min_success=0.8)
    for r in overlapped:
        # every background round was applied (the two syncs block), each exactly
        # averaged - snapshot, with the averaged values exactly what the round returned
        assert r["checks"]["applied"] == r["rounds_done"] - 2, r
        assert r["checks"]["bad"] == 0, r
    over_acc, block_acc = overlapped[0]["accuracy"], blocking[0]["accuracy"]
    print(f"overlap {over_acc:.4f} vs blocking {block_acc:.4f}")
    assert over_acc > 0.9
    assert abs(over_acc - block_acc) <= 0.02, (over_acc, block_acc)
