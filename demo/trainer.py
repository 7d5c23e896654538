"""One demo trainer: Moshpit SGD (moshpit.Optimizer around AdamW) on the results benchmark's
byte-level transformer (bench.swarm.workload), on its own stream of the training text.

Run by demo.run as a separate process (never forked: torch threads and the client's socket do
not survive fork). Lines go to stdout prefixed with the rank; demo.run parses some of them.
With --leave-at the trainer SIGKILLs itself part-way; with --join it waits for a line on stdin
(its daemon is up), then starts from the state its peers' daemons serve (parameters, optimizer
state, step) instead of from its own weights.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from collections.abc import Callable

import torch

import moshpit
from bench.swarm.workload import (
    PRESETS,
    Batches,
    Hyper,
    build_model,
    count_parameters,
    evaluate,
    lm_loss,
    make_optimizer,
    model_config,
)

INIT_SEED = 0  # the same initial weights everywhere, so early averages do not cancel out
JOIN_SEED = 12345  # a joiner's own initial weights differ from the swarm's: the download matters
DATA_SEED = 0  # with the stream (--shard) and the samples seen, it picks Batches' windows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=4, help="trainers at any time")
    p.add_argument("--shard", type=int, help="whose data stream to train on (default: the "
                   "rank's); a joiner takes over the leaver's")
    p.add_argument("--socket", required=True, help="IPC socket of this trainer's moshpitd")
    p.add_argument("--model", default="tiny", choices=sorted(PRESETS),
                   help="bench.swarm.workload's preset")
    p.add_argument("--steps", type=int, default=500, help="local steps of each trainer")
    p.add_argument("--batch", type=int, default=16, help="windows of the model's context")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--average-every", type=int, default=4, help="local steps between rounds")
    p.add_argument("--eval-every", type=int, default=20,
                   help="steps between validation losses (a multiple of --average-every "
                   "evaluates just-averaged weights)")
    p.add_argument("--timeout", type=float, default=2.0,
                   help="seconds per averaging round: a trainer a round behind the others (a "
                   "joiner often is) waits this long in vain at its last one")
    p.add_argument("--sync-timeout", type=float, default=60.0,
                   help="seconds for the first and last rounds, with everyone, and for the "
                   "joiner's download")
    p.add_argument("--leave-at", type=float, default=0.0,
                   help="SIGKILL this trainer after this fraction of its steps (0: never)")
    p.add_argument("--join", action="store_true",
                   help="join a running job: wait for a line on stdin (the daemon at --socket "
                   "is up; an empty one: give up), download the state from peers, train")
    p.add_argument("--local-world", type=int,
                   help="one of this many trainers of its host (demo.run --per-host): they "
                   "average as one peer of the swarm, their daemon's (local_world)")
    p.add_argument("--all-rounds", action="store_true",
                   help="print every round on every rank (default: rank 0 only)")
    return p.parse_args(argv)


def describe(opt: moshpit.Optimizer, ok: bool) -> str:
    info = opt.last_round
    if not ok or info is None:
        return f"FAILED ({opt.last_error})"
    return f"group of {info.group_size}, {info.seconds:.3f} s{local_ranks(info)}"


def local_ranks(info: moshpit.RoundInfo) -> str:
    """With --local-world: the local trainers whose mean the host sent."""
    return f", local ranks {list(info.local_ranks)}" if info.local_ranks else ""


def train(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    torch.set_num_threads(1)  # every trainer and daemon of the demo shares the machine's cores
    shard = args.rank if args.shard is None else args.shard
    hyper = Hyper(args.batch, model_config(args.model).context, args.lr, args.weight_decay)
    model = build_model(args.model, seed=JOIN_SEED if args.join else INIT_SEED)
    inner = make_optimizer(model, hyper)
    total = args.steps
    leave_at = round(total * args.leave_at) if args.leave_at > 0 else -1

    def validation_loss() -> float:
        return evaluate(model.state_dict(), args.model)

    say(f"{args.model} model, {count_parameters(model):,} parameters; "
        f"stream {shard}, batches of {hyper.batch} x {hyper.seq_len} bytes, {total} steps")
    # a joiner scores its fresh weights (and so loads the text) now: joining is quick later
    fresh = validation_loss() if args.join else math.nan
    if args.join:
        say("ready, with fresh weights; waiting for its daemon to join the swarm through")
        if not sys.stdin.readline().strip():
            say("no daemon started: not joining")
            return 1
    # the swarm's peers are hosts: with --local-world, each host's trainers average as one
    peers = args.world // (args.local_world or 1)
    opt = moshpit.Optimizer(inner, client=args.socket, key="demo",
                            average_every=args.average_every, group_size=peers,
                            model=model, average_state=True, timeout=args.timeout,
                            local_world=args.local_world)
    if args.join:
        start = opt.load_state_from_peers(timeout=args.sync_timeout)
        say(f"joined: validation loss {fresh:.3f} with its own fresh weights, "
            f"{validation_loss():.3f} with the state downloaded from peers; "
            f"resuming at step {start}/{total}")
    else:  # the same initial weights everywhere, but a first collective round all the same
        synced = opt.sync(min_group_size=peers, timeout=args.sync_timeout)
        say(f"first round with everyone: {describe(opt, synced)}")
        say(f"step 0/{total}: validation loss {validation_loss():.3f}")
    # a joiner resumes the stream where the downloaded step leaves it, not at its start
    batches = Batches(hyper.batch, hyper.seq_len, DATA_SEED, shard, opt.local_step * hyper.batch)
    show_rounds = args.rank == 0 or args.all_rounds
    first = opt.local_step
    parent, began = os.getppid(), time.monotonic()
    loss_sum, seen = 0.0, 0
    while opt.local_step < total:
        loss = lm_loss(model, batches.next())
        opt.zero_grad()
        loss.backward()
        done = opt.rounds_done  # failed rounds: moshpit logs a warning
        opt.step(batch_size=hyper.batch)
        loss_sum, seen = loss_sum + loss.item(), seen + 1
        step = opt.local_step
        if opt.rounds_done > done and show_rounds and opt.last_round is not None:
            say(f"round {opt.rounds_done} at step {step}/{total}: {describe(opt, True)}")
        if step % args.eval_every == 0 or step == total:
            say(f"step {step}/{total}: train loss {loss_sum / seen:.3f}, validation loss "
                f"{validation_loss():.3f}")
            loss_sum, seen = 0.0, 0
        if step == leave_at:
            say(f"leaving: killed at step {step}/{total}")
            os.kill(os.getpid(), signal.SIGKILL)
        if os.getppid() != parent:  # the orchestrator died: nobody is listening any more
            raise SystemExit("orchestrator gone")
    # The last round waits for everyone, so that all trainers end with one model.
    synced = opt.sync(min_group_size=peers, timeout=args.sync_timeout)
    say(f"trained {total - first} steps in {time.monotonic() - began:.1f} s, "
        f"{opt.rounds_done} rounds ok, {opt.failed_rounds} failed; last round with everyone: "
        f"{describe(opt, synced)}; final validation loss {validation_loss():.4f}")
    if args.local_world and args.rank % args.local_world == 0 and isinstance(opt.client,
                                                                             moshpit.Client):
        # what the daemon did for its host; under load a round can fail or find nobody, and
        # its group is then 0 or 1: such rounds are counted, not shown as group sizes
        mine = [r for r in opt.client.rounds() if r["key"] == "demo"]
        sizes = [r["group_size"] for r in mine if r["result"] == "ok"]
        say(f"host {args.rank // args.local_world}: {len(sizes)} rounds under 'demo' as one "
            f"peer, group sizes {sorted(set(sizes))}, {len(mine) - len(sizes)} not averaged")
    opt.close()
    return 0 if synced else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def say(msg: str) -> None:
        print(f"[rank {args.rank}] {msg}", flush=True)

    try:
        return train(args, say)
    except KeyboardInterrupt:
        return 130
    except moshpit.MoshpitError as exc:  # e.g. no state to download: nothing to demonstrate
        say(f"giving up: {exc!r}")
        return 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # No interpreter teardown: torch's takes about half a second of CPU, which the trainers
    # still running need, and nothing is left to release (opt.close() closed the client).
    os._exit(code)
