"""bench.diloco's numbers: every final model evaluated on bench.swarm's validation windows, the
ratio to the baseline, the trainers' agreement, and the bytes against DDP's."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

GOAL = 0.02  # DiLoCo's validation loss within 2 % of the baseline's
DDP_FORMULA = ("DDP sends 2 (n - 1) / n x 4 P bytes per trainer per step: a ring all-reduce "
               "(reduce-scatter then all-gather) of the float32 gradient of P parameters over "
               "n trainers")


@dataclass(frozen=True)
class RunResult:
    """One H: what each trainer's `done` said, its daemon's tensor bytes sent, the wall time."""

    every: int
    trainers: list[dict[str, Any]]
    sent: list[float]
    wall_s: float


def ddp_bytes(params: int, trainers: int, steps: int) -> float:
    """Bytes one trainer sends in `steps` steps of DDP (DDP_FORMULA)."""
    return steps * 2 * (trainers - 1) / trainers * 4 * params


def max_abs_diff(states: list[dict[str, Any]]) -> float:
    diff = 0.0
    for name, ref in states[0].items():
        for other in states[1:]:
            diff = max(diff, float((other[name].float() - ref.float()).abs().max()))
    return diff


def summarize(args: argparse.Namespace, runs: list[RunResult], base: dict[str, Any]
              ) -> dict[str, Any]:
    import torch

    from bench.swarm.workload import build_model, count_parameters, evaluate

    torch.set_num_threads(1)
    params = count_parameters(build_model(args.model))

    def loss_of(path: str) -> float:
        return evaluate(torch.load(path, map_location="cpu", weights_only=True), args.model)

    baseline = {"batch": args.trainers * args.batch, "steps": args.steps,
                "val_loss": loss_of(base["path"]), "train_loss": base["train_loss"],
                "seconds": base["seconds"]}
    out: dict[str, Any] = {
        "config": {"trainers": args.trainers, "steps": args.steps, "batch": args.batch,
                   "model": args.model, "parameters": params, "lr": args.lr,
                   "weight_decay": args.weight_decay, "codec": args.codec,
                   "outer": "SGD lr 0.7 momentum 0.9 nesterov", "every": args.every},
        "initial_loss": evaluate(build_model(args.model).state_dict(), args.model),
        "baseline": baseline, "goal": GOAL, "ddp_formula": DDP_FORMULA, "runs": []}
    for run in runs:
        states = [torch.load(t["path"], map_location="cpu", weights_only=True)
                  for t in run.trainers]
        losses = [evaluate(s, args.model) for s in states]
        loss = sum(losses) / len(losses)
        ratio = loss / baseline["val_loss"]
        sent = sum(run.sent) / len(run.sent)
        ddp = ddp_bytes(params, args.trainers, args.steps)
        want = args.steps // run.every
        out["runs"].append({
            "every": run.every, "val_loss": loss, "val_losses": losses, "ratio": ratio,
            "within_goal": bool(ratio <= 1 + GOAL),
            "outer_steps": [t["outer_steps"] for t in run.trainers],
            "failed": [t["failed"] for t in run.trainers],
            "groups": [t["groups"] for t in run.trainers],
            "completed": all(t["outer_steps"] == want and t["failed"] == 0
                             for t in run.trainers) and all(map(math.isfinite, losses)),
            "outer_steps_expected": want,
            "max_abs_diff": max_abs_diff(states),
            "sent_bytes_per_trainer": sent, "sent_bytes": run.sent,
            "ddp_bytes_per_trainer": ddp, "ddp_over_diloco": ddp / sent if sent else math.inf,
            "round_seconds_mean": sum(t["round_seconds"] for t in run.trainers)
            / max(1, sum(t["outer_steps"] for t in run.trainers)),
            "train_loss": sum(t["train_loss"] for t in run.trainers) / len(run.trainers),
            "wall_s": run.wall_s,
            "errors": [t["last_error"] for t in run.trainers if t["last_error"]]})
    return out


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def table(results: dict[str, Any]) -> str:
    cfg, base = results["config"], results["baseline"]
    lines = [f"{cfg['trainers']} DiLoCo trainers (batch {cfg['batch']}, codec {cfg['codec']}, "
             f"outer {cfg['outer']}) against one process with batch {base['batch']}; "
             f"{cfg['steps']} inner steps each, model {cfg['model']} "
             f"({cfg['parameters']:,} parameters), AdamW lr {cfg['lr']:g}; validation loss in "
             f"nats per byte (untrained: {results['initial_loss']:.3f})", "",
             "| run | val loss | vs baseline | outer steps ok (failed) | max |diff| between "
             "trainers | sent/trainer | DDP would send | DDP / DiLoCo | wall |",
             "|---|---|---|---|---|---|---|---|---|",
             f"| baseline, batch {base['batch']} | {base['val_loss']:.4f} | - | - | - | 0 | - "
             f"| - | {base['seconds']:.0f} s |"]
    for run in results["runs"]:
        ok = "/".join(str(s) for s in run["outer_steps"])
        lines.append(
            f"| DiLoCo H={run['every']} | {run['val_loss']:.4f} "
            f"| {100 * (run['ratio'] - 1):+.2f} % | {ok} of {run['outer_steps_expected']} "
            f"({sum(run['failed'])}) | {run['max_abs_diff']:.1e} "
            f"| {_mb(run['sent_bytes_per_trainer'])} | {_mb(run['ddp_bytes_per_trainer'])} "
            f"| {run['ddp_over_diloco']:.0f}x | {run['wall_s']:.0f} s |")
    lines.append("")
    for run in results["runs"]:
        verdict = "meets" if run["within_goal"] else "MISSES"
        lines.append(f"H={run['every']}: DiLoCo's loss is {100 * (run['ratio'] - 1):+.2f} % of "
                     f"the baseline's ({verdict} the {100 * results['goal']:.0f} % goal)"
                     + (f"; errors: {run['errors'][:2]}" if run["errors"] else ""))
    lines.append(f"bytes: sent/trainer is the daemons' {'moshpitd_sent_bytes_total'} (tensor "
                 f"bytes, every round); {results['ddp_formula']}.")
    return "\n".join(lines)
