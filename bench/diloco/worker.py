"""One process of bench.diloco: a DiLoCo trainer with its own moshpitd, or the baseline that
trains alone on the whole batch. `python -m bench.diloco.worker --spec '<json>'`.

Protocol (JSON lines on stdout, one `go` line on stdin, as bench.training_worker's): it builds
the model, optimizers and data, prints {"event": "ready"}, waits for `go`, trains `steps` inner
steps and saves its final model, then prints {"event": "done"} with what it did, or
{"event": "error"}.

Both kinds start from bench.swarm's model (the same seeded weights) with bench.swarm's AdamW;
each process draws its own stream of training windows (bench.swarm's Batches with host =
rank; the baseline's rank is the number of trainers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.swarm.workload import Batches, Hyper, build_model, lm_loss, make_optimizer

TRAIN_LOSS_TAIL = 20  # steps whose mean training loss the `done` event reports
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # DiLoCo's outer SGD with Nesterov momentum


@dataclass(frozen=True)
class WorkerSpec:
    role: str  # "diloco" or "baseline"
    rank: int
    trainers: int
    model: str
    batch: int
    seq_len: int
    lr: float
    weight_decay: float
    steps: int
    out: str  # where the final state_dict goes (torch.save)
    every: int = 0  # H (diloco)
    codec: str = "none"
    socket: str = ""  # this trainer's moshpitd (diloco)
    key: str = ""
    timeout: float = 60.0

    @classmethod
    def parse(cls, text: str) -> WorkerSpec:
        spec = cls(**json.loads(text))
        if spec.role not in ("diloco", "baseline"):
            raise ValueError(f"role must be diloco or baseline, not {spec.role!r}")
        if spec.role == "diloco" and (spec.every < 1 or not spec.socket or not spec.key):
            raise ValueError("a diloco trainer needs every >= 1, socket and key")
        return spec

    @property
    def hyper(self) -> Hyper:
        return Hyper(self.batch, self.seq_len, self.lr, self.weight_decay)


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def wait_for_go() -> None:
    """Blocks until the orchestrator says go; EOF (it went away) ends the process quietly."""
    if sys.stdin.readline().strip() != "go":
        raise SystemExit(0)


def train(spec: WorkerSpec) -> dict[str, Any]:
    model = build_model(spec.model, seed=0)
    inner = make_optimizer(model, spec.hyper)
    batches = Batches(spec.batch, spec.seq_len, seed=0, host=spec.rank)
    opt: Any = inner
    client = None
    groups: Counter[int] = Counter()  # group size -> outer steps
    round_seconds = 0.0
    if spec.role == "diloco":
        import moshpit
        from bench.swarm.systems.moshpit_sgd import connect
        client = connect(spec.socket)  # the daemon may still be starting
        outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM,
                                nesterov=True)
        # the whole swarm in every round (min_group_size = trainers): an outer step averages
        # every trainer's pseudo-gradient, as the comparison with batch trainers x b assumes
        opt = moshpit.Optimizer(inner, client=client, key=spec.key, average_every=spec.every,
                                group_size=spec.trainers, min_group_size=spec.trainers,
                                timeout=spec.timeout, codec=spec.codec, outer_optimizer=outer,
                                publish_every=0)
    emit("ready", pid=os.getpid())
    wait_for_go()
    losses: list[float] = []
    t0 = time.perf_counter()
    for _ in range(spec.steps):
        inner.zero_grad(set_to_none=True)
        loss = lm_loss(model, batches.next())
        loss.backward()
        losses.append(float(loss.detach()))
        if spec.role == "diloco":
            done = opt.rounds_done
            opt.step(batch_size=spec.batch)
            if opt.rounds_done > done and opt.last_round is not None:
                groups[opt.last_round.group_size] += 1
                round_seconds += opt.last_round.seconds
        else:
            opt.step()
    seconds = time.perf_counter() - t0
    result: dict[str, Any] = {"steps": spec.steps, "seconds": seconds,
                              "train_loss": statistics.fmean(losses[-TRAIN_LOSS_TAIL:])}
    if spec.role == "diloco":
        opt.finish()
        result.update(outer_steps=opt.rounds_done, failed=opt.failed_rounds,
                      groups={str(k): v for k, v in sorted(groups.items())},
                      round_seconds=round_seconds,
                      last_error=None if opt.last_error is None else str(opt.last_error)[:300])
        opt.close()
        client.close()  # type: ignore[union-attr]
    path = Path(spec.out)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, path)
    result["path"] = str(path)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", required=True, help="the WorkerSpec as JSON")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    try:
        spec = WorkerSpec.parse(args.spec)
        emit("done", **train(spec))
    except Exception as exc:
        traceback.print_exc()
        emit("error", message=f"{type(exc).__name__}: {exc}"[:500])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
