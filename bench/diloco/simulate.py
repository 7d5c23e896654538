"""`python -m bench.diloco.simulate`: bench.diloco's arithmetic in one process, no network.

The same model, data streams, inner AdamW and batch sizes as bench.diloco, but the trainers are
models of this process taking turns and the pseudo-gradients' mean is exact (float32), so it
separates what DiLoCo itself does from what the transport adds. It evaluates every --eval-every
steps (the mean of the local models between syncs), which bench.diloco does not, and takes any
outer learning rate and momentum: outer lr 1 without momentum is plain parameter averaging
(local SGD), and H = 1 with it averages after every step.

    python -m bench.diloco.simulate --runs base,10:0.7:0.9,10:1:0,1:1:0
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from bench.swarm.workload import (
    DEFAULT_HYPER,
    Batches,
    build_model,
    evaluate,
    lm_loss,
    make_optimizer,
    model_config,
)


def parse_run(text: str) -> tuple[int, float, float] | None:
    """`base` (None) or H:outer_lr:outer_momentum."""
    if text == "base":
        return None
    try:
        every, lr, momentum = text.split(":")
        return int(every), float(lr), float(momentum)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a run is base or H:outer_lr:momentum, not {text!r}"
                                         ) from None


def baseline(args: argparse.Namespace) -> list[float]:
    model = build_model(args.model)
    opt = make_optimizer(model, DEFAULT_HYPER)
    batches = Batches(args.trainers * args.batch, model_config(args.model).context, 0,
                      args.trainers)
    curve = []
    for step in range(1, args.steps + 1):
        opt.zero_grad(set_to_none=True)
        lm_loss(model, batches.next()).backward()
        opt.step()
        if step % args.eval_every == 0:
            curve.append(evaluate(model.state_dict(), args.model))
    return curve


def diloco(args: argparse.Namespace, every: int, outer_lr: float, momentum: float
           ) -> list[float]:
    models = [build_model(args.model) for _ in range(args.trainers)]
    inner = [make_optimizer(m, DEFAULT_HYPER) for m in models]
    context = model_config(args.model).context
    batches = [Batches(args.batch, context, 0, r) for r in range(args.trainers)]
    params = [list(m.parameters()) for m in models]
    global_params = [p.detach().clone().requires_grad_(True) for p in params[0]]
    outer = torch.optim.SGD(global_params, lr=outer_lr, momentum=momentum,
                            nesterov=momentum > 0)
    curve = []
    for step in range(1, args.steps + 1):
        for model, opt, data in zip(models, inner, batches, strict=True):
            opt.zero_grad(set_to_none=True)
            lm_loss(model, data.next()).backward()
            opt.step()
        if step % every == 0:
            with torch.no_grad():
                for i, g in enumerate(global_params):
                    g.grad = sum(g - ps[i] for ps in params) / args.trainers
                outer.step()
                for ps in params:
                    for p, g in zip(ps, global_params, strict=True):
                        p.copy_(g)
        if step % args.eval_every == 0:
            states = [m.state_dict() for m in models]
            mean = {k: sum(s[k] for s in states) / len(states) for k in states[0]}
            curve.append(evaluate(mean, args.model))
    return curve


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.diloco.simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default="base,10:0.7:0.9,50:0.7:0.9",
                   help="comma-separated: base (one process, batch trainers x b) or "
                        "H:outer_lr:outer_momentum")
    p.add_argument("--trainers", type=int, default=4)
    p.add_argument("--batch", type=int, default=DEFAULT_HYPER.batch)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--model", default="small")
    p.add_argument("--json", action="store_true", help="one JSON object per run on stdout")
    args = p.parse_args(argv)
    runs = [parse_run(r) for r in args.runs.split(",") if r]
    torch.set_num_threads(1)
    steps = list(range(args.eval_every, args.steps + 1, args.eval_every))
    if not args.json:
        print("run".ljust(16) + "".join(f"{s:>8}" for s in steps) + "   (validation loss at "
              "step; nats per byte)")
    for run in runs:
        t0 = time.perf_counter()
        curve = baseline(args) if run is None else diloco(args, *run)
        name = "baseline" if run is None else f"H={run[0]} {run[1]:g}/{run[2]:g}"
        out: dict[str, Any] = {"run": name, "steps": steps, "val_loss": curve,
                               "seconds": time.perf_counter() - t0}
        if args.json:
            print(json.dumps(out), flush=True)
        else:
            print(name.ljust(16) + "".join(f"{x:8.4f}" for x in curve), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
