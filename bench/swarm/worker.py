"""One host's trainer in the results benchmark: `python -m bench.swarm.worker --spec SPEC.json`.

The orchestrator starts it in the host's network namespace and cgroup (cwd = repo root,
PYTHONPATH = repo root) with `.venv/bin/python` for ddp and moshpit and
`.venv-peers/bin/python` for hivemind-*; so this module and bench.swarm.workload import
neither moshpit nor hivemind, only the chosen system's module does.

SPEC.json: system, host, hosts, host_ips, port_base (ports port_base..+9 are the worker's),
seed, model, batch, seq_len, lr, weight_decay, budget_s, start_at (or null and start_file),
out_dir, shared_dir, snapshot_every_s, rejoin, ipc_socket (moshpit), ddp {world, generation,
master, resume, checkpoint_every_s} (ddp), knobs {...} (per system, see each module in
bench/swarm/systems), trainer and trainers_per_host (default 0 and 1: this process is trainer
`trainer` of its host's trainers_per_host, each on its own data; bench/swarm/layout.py).

stdout carries one JSON object per line, each with "event" and "t" (time.time()):
ready {step, samples} (where it starts from), progress {step, samples, loss} about once a
second, sync {ok, group_size, seconds} per averaging round or optimizer epoch, snapshot
{step, samples, path} every snapshot_every_s, checkpoint {step, samples, path} (ddp rank 0),
budget {step, samples, path, late_s} once the budget is over (the model the host holds then,
before any final sync: the one the table scores; late_s is how far past the deadline the step
in flight ended), done {step, samples, path} (after the system's own final sync, if it has
one), error {message}.
`samples` counts the training sequences this host has processed, including those before a
resume that survived in the checkpoint. `seed` sets the order of the data; every host of
every system starts from the same weights, whatever the seed (workload.MODEL_SEED).
Training runs from max(now, start) until start + budget_s, where start is start_at, or
(start_at null) the unix time the orchestrator writes into start_file (atomically, by rename)
once every host is ready. stderr is a free-form log.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.swarm.systems import DAEMON_SYSTEMS, DDP_SYSTEMS, MODULES
from bench.swarm.workload import (
    MODEL_SEED,
    Batches,
    Hyper,
    build_model,
    check_seq_len,
    lm_loss,
    make_optimizer,
    model_config,
)

PROGRESS_EVERY_S = 1.0
START_WAIT_S = 900.0  # an orchestrator that never writes the start file has gone away

log = logging.getLogger("bench.swarm.worker")


class SpecError(ValueError):
    """SPEC.json is missing a field or holds a value the worker cannot use."""


@dataclass(frozen=True)
class DDPSpec:
    world: tuple[int, ...]  # host indexes in rank order
    generation: int
    master: str  # ip:port of the rendezvous store (rank 0's host)
    resume: str | None
    checkpoint_every_s: float


@dataclass(frozen=True)
class WorkerSpec:
    system: str
    host: int
    hosts: int
    host_ips: tuple[str, ...]
    port_base: int
    seed: int
    model: str
    batch: int
    seq_len: int
    lr: float
    weight_decay: float
    budget_s: float
    start_at: float | None  # None: read it from start_file once it appears
    out_dir: Path
    shared_dir: Path
    snapshot_every_s: float
    rejoin: bool = False
    ipc_socket: str | None = None
    ddp: DDPSpec | None = None
    knobs: dict[str, Any] = field(default_factory=dict)
    start_file: Path | None = None
    trainer: int = 0  # of trainers_per_host on this host
    trainers_per_host: int = 1

    @property
    def ip(self) -> str:
        return self.host_ips[self.host]

    @property
    def hyper(self) -> Hyper:
        return Hyper(self.batch, self.seq_len, self.lr, self.weight_decay)

    def knob(self, name: str, default: Any) -> Any:
        return self.knobs.get(name, default)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> WorkerSpec:
        try:
            ddp = raw.get("ddp")
            spec = cls(
                system=str(raw["system"]), host=int(raw["host"]), hosts=int(raw["hosts"]),
                host_ips=tuple(str(ip) for ip in raw["host_ips"]),
                port_base=int(raw["port_base"]), seed=int(raw.get("seed", 0)),
                model=str(raw["model"]), batch=int(raw["batch"]), seq_len=int(raw["seq_len"]),
                lr=float(raw["lr"]), weight_decay=float(raw["weight_decay"]),
                budget_s=float(raw["budget_s"]),
                start_at=None if raw.get("start_at") is None else float(raw["start_at"]),
                start_file=None if raw.get("start_file") is None else Path(raw["start_file"]),
                out_dir=Path(raw["out_dir"]), shared_dir=Path(raw["shared_dir"]),
                snapshot_every_s=float(raw.get("snapshot_every_s", 6.0)),
                rejoin=bool(raw.get("rejoin", False)), ipc_socket=raw.get("ipc_socket"),
                ddp=None if ddp is None else DDPSpec(
                    tuple(int(h) for h in ddp["world"]), int(ddp.get("generation", 0)),
                    str(ddp["master"]), ddp.get("resume"),
                    float(ddp.get("checkpoint_every_s", 30.0))),
                knobs=dict(raw.get("knobs") or {}), trainer=int(raw.get("trainer", 0)),
                trainers_per_host=int(raw.get("trainers_per_host", 1)))
        except (KeyError, TypeError, ValueError) as exc:
            raise SpecError(f"bad worker spec: {type(exc).__name__}: {exc}") from exc
        spec.validate()
        return spec

    def validate(self) -> None:
        if self.system not in MODULES:
            raise SpecError(f"system {self.system!r} is not one of {', '.join(MODULES)}")
        if not 0 <= self.host < self.hosts or len(self.host_ips) != self.hosts:
            raise SpecError(f"host {self.host} of {self.hosts} with {len(self.host_ips)} IPs")
        if not 0 <= self.trainer < self.trainers_per_host:
            raise SpecError(f"trainer {self.trainer} of {self.trainers_per_host} per host")
        if min(self.batch, self.seq_len) < 1 or self.budget_s <= 0 or self.lr <= 0:
            raise SpecError("batch, seq_len, budget_s and lr must be positive")
        try:
            model_config(self.model)
            check_seq_len(self.model, self.seq_len)
        except ValueError as exc:
            raise SpecError(str(exc)) from None
        if self.start_at is None and self.start_file is None:
            raise SpecError("the spec needs start_at or start_file")
        if self.system in DAEMON_SYSTEMS and not self.ipc_socket:
            raise SpecError(f"the {self.system} system needs ipc_socket (the host's moshpitd)")
        if self.system in DDP_SYSTEMS and (self.ddp is None or self.host not in self.ddp.world):
            raise SpecError(f"the {self.system} system needs ddp.world holding host {self.host}")


class Events:
    """The JSON lines on stdout: the worker's whole interface to the orchestrator."""

    def emit(self, event: str, **fields: Any) -> None:
        sys.stdout.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")
        sys.stdout.flush()


class LocalTrainer:
    """The model, AdamW and data of one host, plus the time-driven progress and snapshots
    every system reports alike. Systems call compute_loss(), their optimizer step, then
    advance()."""

    def __init__(self, spec: WorkerSpec, events: Events, step: int = 0,
                 samples: int = 0) -> None:
        self.spec, self.events = spec, events
        self.model = build_model(spec.model, MODEL_SEED)
        self.optimizer: torch.optim.Optimizer = make_optimizer(self.model, spec.hyper)
        self.batches = Batches(spec.batch, spec.seq_len, spec.seed, spec.host, samples,
                               spec.trainer)
        self.step, self.samples = step, samples
        self.loss_sum, self.loss_n = 0.0, 0
        self._snapshots = 0
        self._next_progress = self._next_snapshot = math.inf
        self.deadline = math.inf  # start + budget_s, known once wait_for_start returns
        spec.out_dir.mkdir(parents=True, exist_ok=True)

    def compute_loss(self, module: torch.nn.Module | None = None) -> float:
        """zero_grad, forward and backward on the next batch; returns the loss."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(module if module is not None else self.model, self.batches.next())
        loss.backward()
        value = float(loss.detach())
        self.loss_sum += value
        self.loss_n += 1
        return value

    def wait_for_start(self) -> None:
        """`ready`, then wait for the start: spec.start_at, or the unix time the orchestrator
        writes into spec.start_file once every host is ready."""
        self.events.emit("ready", host=self.spec.host, trainer=self.spec.trainer,
                         pid=os.getpid(), step=self.step, samples=self.samples)
        start = self.spec.start_at
        if start is None:
            assert self.spec.start_file is not None  # WorkerSpec.validate
            start = wait_for_file(self.spec.start_file)
        self.deadline = start + self.spec.budget_s
        delay = start - time.time()
        if delay > 0:
            time.sleep(delay)
        now = time.time()
        self._next_progress = now + PROGRESS_EVERY_S
        self._next_snapshot = now + self.spec.snapshot_every_s

    def time_left(self) -> float:
        return self.deadline - time.time()

    def advance(self, steps: int = 1) -> None:
        self.step += steps
        self.samples += steps * self.spec.batch
        now = time.time()
        if now >= self._next_progress:
            self._next_progress = now + PROGRESS_EVERY_S
            loss = self.loss_sum / self.loss_n if self.loss_n else None
            self.loss_sum, self.loss_n = 0.0, 0
            self.events.emit("progress", step=self.step, samples=self.samples, loss=loss)
        if now >= self._next_snapshot:
            self._next_snapshot = now + self.spec.snapshot_every_s
            self.snapshot("snapshot")

    def end_of_budget(self) -> Path:
        """Saves the model this host holds when its training loop ends at the deadline: what
        the benchmark scores for every system (a final sync a system runs after it is not)."""
        return self.snapshot("budget", late_s=max(0.0, time.time() - self.deadline))

    def snapshot(self, event: str, **fields: Any) -> Path:
        """torch.save of the model's state_dict under out_dir, then the event naming it."""
        self._snapshots += 1
        name = {"done": "final.pt", "budget": "budget.pt"}.get(
            event, f"snap-{self._snapshots:04d}.pt")
        path = self.spec.out_dir / name
        tmp = path.with_suffix(".tmp")
        torch.save({k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
                   tmp)
        os.replace(tmp, path)
        self.events.emit(event, step=self.step, samples=self.samples, path=str(path), **fields)
        return path


def wait_for_file(path: Path, poll_s: float = 0.05, timeout_s: float = START_WAIT_S) -> float:
    """The float in `path`, once a complete one is there (the orchestrator's start signal)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return float(path.read_text().strip())
        except (FileNotFoundError, ValueError):  # not yet written, or written half
            if time.monotonic() > deadline:
                raise TimeoutError(f"no start time in {path} after {timeout_s:.0f} s") from None
            time.sleep(poll_s)


def load_spec(path: str) -> WorkerSpec:
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SpecError(f"cannot read the spec {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise SpecError(f"{path} does not hold a JSON object")
    return WorkerSpec.from_dict(raw)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", required=True, help="SPEC.json written by the orchestrator")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    events = Events()
    try:
        spec = load_spec(args.spec)
        torch.set_num_threads(1)
        system = importlib.import_module(MODULES[spec.system])
        system.run(spec, events)
    except Exception as exc:
        traceback.print_exc()
        events.emit("error", message=f"{type(exc).__name__}: {exc}"[:500])
        code = 1
    else:
        code = 0
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: gloo or hivemind's helpers may hang it


if __name__ == "__main__":
    sys.exit(main())
