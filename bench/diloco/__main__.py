"""`python -m bench.diloco`: does Moshpit DiLoCo train as well as one process on the whole batch?

N trainers (each a process with its own moshpitd on loopback) run DiLoCo on bench.swarm's
byte-level language model and corpus: inner AdamW (bench.swarm's), every H steps the
pseudo-gradients averaged by the whole swarm and stepped by outer SGD (lr 0.7, momentum 0.9,
Nesterov). The baseline is one process taking the same number of inner steps with batch N x b,
so both see the same number of samples. Reported: the validation loss of both and their ratio
(the goal: within 2 %), and the bytes each trainer sent for averaging (the daemons' tensor byte
counters) against what DDP would send (a ring all-reduce of the float32 gradient every step).

    python -m bench.diloco                      # 4 trainers, H = 10 and 50, 300 steps
    python -m bench.diloco --every 50 --steps 600 --codec int4
    python -m bench.diloco --smoke --json       # what the test suite runs
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.cli import exit_on_sigterm, positive
from bench.diloco.report import RunResult, summarize, table
from bench.procs import Child, Children, child_env
from moshpitd.launcher import LocalSwarm

SENT_METRIC = "moshpitd_sent_bytes_total"
STEP_BOUND_S = 3.0  # a generous bound on one inner step of the small model on a loaded core
START_BOUND_S = 180.0  # imports, corpus, connecting: before the first step


T0 = time.monotonic()


def say(message: str) -> None:
    print(f"[bench.diloco {time.monotonic() - T0:5.1f} s] {message}", file=sys.stderr,
          flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from bench.swarm.workload import DEFAULT_HYPER, PRESETS

    p = argparse.ArgumentParser(prog="python -m bench.diloco", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainers", type=positive, help="DiLoCo trainers (default 4; --smoke 2)")
    p.add_argument("--every", help="comma-separated H values, one run each (default 10,50; "
                   "--smoke 10)")
    p.add_argument("--steps", type=positive, help="inner steps of every process (default 300; "
                   "--smoke 20); a multiple of every H, so every run ends on an outer step")
    p.add_argument("--batch", type=positive, default=DEFAULT_HYPER.batch,
                   help="b: sequences per step per trainer; the baseline takes trainers x b")
    p.add_argument("--model", choices=sorted(PRESETS), help="default small; --smoke: tiny")
    p.add_argument("--lr", type=float, default=DEFAULT_HYPER.lr, help="inner AdamW's")
    p.add_argument("--weight-decay", type=float, default=DEFAULT_HYPER.weight_decay)
    p.add_argument("--codec", default="fp16", choices=("none", "fp16", "bf16", "int8", "int4"),
                   help="how pseudo-gradients travel (default fp16, as OpenDiLoCo)")
    p.add_argument("--timeout", type=float, default=120.0, help="per outer round, seconds")
    p.add_argument("--out", type=Path, help="keep the final models here (default: a temporary "
                   "directory, removed)")
    p.add_argument("--json", action="store_true", help="the results as JSON on stdout (the "
                   "table goes to stderr)")
    p.add_argument("--smoke", action="store_true", help="2 trainers, tiny model, 20 steps, "
                   "H = 10: seconds, for the test suite")
    args = p.parse_args(argv)
    args.trainers = args.trainers or (2 if args.smoke else 4)
    args.model = args.model or ("tiny" if args.smoke else "small")
    args.steps = args.steps or (20 if args.smoke else 300)
    try:
        args.every = [int(h) for h in (args.every or ("10" if args.smoke else "10,50"))
                      .split(",") if h.strip()]
    except ValueError:
        p.error(f"--every takes comma-separated integers, not {args.every!r}")
    if not args.every or min(args.every) < 1:
        p.error("--every needs at least one H >= 1")
    bad = [h for h in args.every if args.steps % h]
    if bad:
        p.error(f"--steps {args.steps} is not a multiple of H = {bad}: each run must end on "
                "an outer step, so the trainers' final models are the synced global copy")
    if args.trainers < 2:
        p.error("--trainers must be at least 2")
    return args


def sent_bytes(metrics_endpoint: str) -> float:
    """A daemon's tensor bytes sent to peers (every codec), from its /metrics."""
    with urllib.request.urlopen(f"http://{metrics_endpoint}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(SENT_METRIC))


def spec_args(args: argparse.Namespace, role: str, rank: int, out: Path, batch: int,
              **extra: Any) -> list[str]:
    from bench.swarm.workload import model_config

    spec = {"role": role, "rank": rank, "trainers": args.trainers, "model": args.model,
            "batch": batch, "seq_len": model_config(args.model).context, "lr": args.lr,
            "weight_decay": args.weight_decay, "steps": args.steps, "out": str(out), **extra}
    return ["--spec", json.dumps(spec)]


def expect(child: Child, event: str, timeout: float) -> dict[str, Any]:
    reply = child.recv(timeout)
    if reply.get("event") != event:
        raise RuntimeError(f"{child.name}: expected {event!r}, got {reply}\n"
                           f"{child.stderr_tail()}")
    return reply


def start_trainers(kids: Children, args: argparse.Namespace, out: Path, every: int,
                   sockets: list[str], env: dict[str, str]) -> list[Child]:
    """The trainers of one H; each connects to its daemon once that one is up."""
    return [kids.start(f"trainer {r} (H={every})", "bench.diloco.worker",
                       spec_args(args, "diloco", r, out / f"h{every}-t{r}.pt", args.batch,
                                 every=every, codec=args.codec, socket=sockets[r],
                                 key=f"diloco-h{every}", timeout=args.timeout), env)
            for r in range(args.trainers)]


def run(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    env = child_env()
    done_bound = START_BOUND_S + args.steps * STEP_BOUND_S
    swarm = LocalSwarm(args.trainers, workdir=out / "daemons")
    # LocalSwarm names its daemons d0, d1, ... with their sockets in its workdir: the first
    # trainers start (import torch, read the corpus) while the daemons start
    sockets = [str(out / "daemons" / f"d{r}.sock") for r in range(args.trainers)]
    with Children() as kids:
        baseline = kids.start("baseline", "bench.diloco.worker",
                              spec_args(args, "baseline", args.trainers, out / "baseline.pt",
                                        args.trainers * args.batch), env)
        trainers = start_trainers(kids, args, out, args.every[0], sockets, env)
        say(f"starting {args.trainers} daemons and the first {args.trainers} trainers")
        with swarm:
            if swarm.sockets != sockets:
                raise RuntimeError(f"the daemons' sockets are {swarm.sockets}, not {sockets}")
            expect(baseline, "ready", START_BOUND_S)
            runs: list[RunResult] = []
            for i, every in enumerate(args.every):
                if i:
                    trainers = start_trainers(kids, args, out, every, sockets, env)
                before = [sent_bytes(d.info["metrics"]) for d in swarm.daemons]
                for child in trainers:
                    expect(child, "ready", START_BOUND_S)
                t0 = time.monotonic()
                for child in trainers + ([baseline] if i == 0 else []):
                    child.send("go")
                say(f"H={every}: {args.trainers} trainers x {args.steps} steps"
                    + (" (the baseline trains alongside)" if i == 0 else ""))
                done = [expect(child, "done", done_bound) for child in trainers]
                wall = time.monotonic() - t0
                after = [sent_bytes(d.info["metrics"]) for d in swarm.daemons]
                runs.append(RunResult(every, done, [b - a for a, b in zip(before, after,
                                                                          strict=True)], wall))
                say(f"H={every}: done in {wall:.0f} s")
            base = expect(baseline, "done", done_bound)
    say("evaluating the final models")
    return summarize(args, runs, base)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()
    out = args.out or Path(tempfile.mkdtemp(prefix="moshpit-diloco-"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        results = run(args, out)
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)
    text = table(results)
    print(text, file=sys.stderr if args.json else sys.stdout, flush=True)
    if args.json:
        print(json.dumps(results))
    ok = all(r["completed"] for r in results["runs"]) and math.isfinite(
        results["baseline"]["val_loss"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
