"""Scoring the models a run saved, after every timed run, outside every host's quota.

Two sets, two purposes (bench/swarm/workload.py):
- the curves: every snapshot, and every host's model at the deadline (`budget`), on the 64
  validation windows (4 KB), cheap enough for a point every few seconds; keyed by file path;
- the end of each run, the number the tables compare: the exact mean of its hosts' models at
  the deadline, on the held-out set (4096 windows, 256 KB). Every system ends the same way:
  one final average, computed here, untimed, whether the system has a final sync of its own
  or not (a sync a system runs after the deadline is not scored). DDP's ranks hold one model,
  so its mean is that model. Keyed `end:<run>`.
- The initial weights (the same for every run) on both: `initial:<model>` and
  `initial-held-out:<model>:<windows>`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from bench.swarm.systems import DDP_SYSTEMS


@dataclass(frozen=True)
class Job:
    key: str
    paths: tuple[str, ...]  # () for the initial weights; several: their mean is scored
    model: str
    held_out: int  # windows of the held-out set; 0: the validation windows


def run_key(record: dict[str, Any]) -> str:
    seed = record.get("seed", record["config"].get("seed", 0))
    return f"{record['scenario']}/{record['system']}/seed{seed}"


def end_key(record: dict[str, Any]) -> str:
    return f"end:{run_key(record)}"


def held_out_key(model: str, windows: int) -> str:
    return f"initial-held-out:{model}:{windows}"


def curve_events(record: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(worker, event) of every snapshot and deadline model on a curve; for DDP, whose ranks
    hold the same model after every step, rank 0's only."""
    for worker in record["workers"]:
        ddp = worker["spec"].get("ddp")
        if ddp is not None and ddp["world"][0] != worker["host"]:
            continue
        for event in worker["events"]:
            if event["event"] in ("snapshot", "budget") and event.get("path"):
                yield worker, event


def end_paths(record: dict[str, Any]) -> list[str]:
    """Every trainer's model at the deadline (a host killed and not back has none)."""
    return [e["path"] for w in record["workers"] for e in w["events"]
            if e["event"] == "budget" and e.get("path")]


def jobs_for(records: list[dict[str, Any]]) -> list[Job]:
    jobs: dict[str, Job] = {}
    for record in records:
        cfg = record["config"]
        model, windows = cfg["model"], int(cfg.get("held_out_windows", 4096))
        for _, event in curve_events(record):
            jobs[event["path"]] = Job(event["path"], (event["path"],), model, 0)
        paths = end_paths(record)
        if record["system"] in DDP_SYSTEMS:
            paths = paths[:1]  # one model: spare the loads
        if paths:
            jobs[end_key(record)] = Job(end_key(record), tuple(paths), model, windows)
        jobs[f"initial:{model}"] = Job(f"initial:{model}", (), model, 0)
        jobs[held_out_key(model, windows)] = Job(held_out_key(model, windows), (), model,
                                                 windows)
    # the long jobs first, so the pool's last minutes are not one process on one long job
    return sorted(jobs.values(), key=lambda j: (-j.held_out * max(1, len(j.paths)), j.key))


@functools.lru_cache(maxsize=4)
def _held_out(model: str, windows: int) -> Any:
    from bench.swarm.workload import held_out_set
    return held_out_set(model, windows)


def score(job: Job) -> float:
    """The job's loss; NaN (and a line on stdout) when a file cannot be read."""
    import torch

    from bench.swarm.workload import MODEL_SEED, build_model, evaluate, mean_state
    try:
        if job.paths:
            states = [torch.load(p, map_location="cpu", weights_only=True) for p in job.paths]
            state = states[0] if len(states) == 1 else mean_state(states)
        else:
            state = build_model(job.model, MODEL_SEED).state_dict()
        windows = _held_out(job.model, job.held_out) if job.held_out else None
        return evaluate(state, model=job.model, windows=windows)
    except Exception as exc:  # one bad file must not lose the whole report
        print(f"cannot evaluate {job.key}: {type(exc).__name__}: {exc}", flush=True)
        return math.nan


def _init() -> None:
    import torch
    torch.set_num_threads(1)


def evaluate_runs(records: list[dict[str, Any]], procs: int = 2) -> dict[str, float]:
    """Every loss the report needs, keyed as the module docstring says."""
    jobs = jobs_for(records)
    if procs <= 1 or len(jobs) <= 1:
        _init()
        return {job.key: score(job) for job in jobs}
    import multiprocessing
    with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_init) as pool:
        losses = list(pool.map(score, jobs, chunksize=1))
    return {job.key: loss for job, loss in zip(jobs, losses, strict=True)}


def initial_loss(model: str) -> float:
    """The initial weights' validation loss (every host of every run starts from them)."""
    _init()
    return score(Job(f"initial:{model}", (), model, 0))
