"""One demo trainer: Moshpit SGD (moshpit.Optimizer around Adam) on one shard of the digits.

Run by demo.run as a separate process (never forked: torch threads and the client's socket do
not survive fork). Lines go to stdout prefixed with the rank; demo.run parses some of them.
With --leave-at the trainer SIGKILLs itself part-way; with --join it starts from the state its
peers' daemons serve (parameters, optimizer state, step) instead of from its own weights.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

import moshpit
from demo.model import INIT_SEED, accuracy, load_shard, make_model

JOIN_SEED = 12345  # a joiner's own initial weights differ from the swarm's: the download matters


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=4, help="trainers at any time (= shards)")
    p.add_argument("--shard", type=int, help="data shard (default: the rank)")
    p.add_argument("--socket", required=True, help="IPC socket of this trainer's moshpitd; "
                   "'-': read it from stdin once everything else is ready (for a joiner)")
    p.add_argument("--data", help="split saved by demo.run (default: load it with sklearn)")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--average-every", type=int, default=4, help="local steps between rounds")
    p.add_argument("--timeout", type=float, default=5.0,
                   help="seconds per averaging round: a trainer a round behind the others (a "
                   "joiner often is) waits this long in vain at its last one")
    p.add_argument("--sync-timeout", type=float, default=60.0,
                   help="seconds for the first and last rounds, with everyone, and for the "
                   "joiner's download")
    p.add_argument("--no-batchnorm", action="store_true", help="a plain MLP")
    p.add_argument("--leave-at", type=float, default=0.0,
                   help="SIGKILL this trainer after this fraction of its steps (0: never)")
    p.add_argument("--join", action="store_true",
                   help="join a running job: download the state from peers before training")
    p.add_argument("--local-world", type=int,
                   help="one of this many trainers of its host (demo.run --per-host): they "
                   "average as one peer of the swarm, their daemon's (local_world)")
    p.add_argument("--all-rounds", action="store_true",
                   help="print every round on every rank (default: rank 0 only)")
    return p.parse_args(argv)


@torch.no_grad()
def shard_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    was_training = model.training
    model.eval()
    loss = float(nn.functional.cross_entropy(model(x), y))
    model.train(was_training)
    return loss


def describe(opt: moshpit.Optimizer, ok: bool) -> str:
    info = opt.last_round
    if not ok or info is None:
        return f"FAILED ({opt.last_error})"
    return f"group of {info.group_size}, {info.seconds:.3f} s{local_ranks(info)}"


def local_ranks(info: moshpit.RoundInfo) -> str:
    """With --local-world: the local trainers whose mean the host sent."""
    return f", local ranks {list(info.local_ranks)}" if info.local_ranks else ""


def train(args: argparse.Namespace, say: Callable[[str], None]) -> int:
    torch.set_num_threads(1)  # 5 trainers and 5 daemons share the cores
    shard = args.rank if args.shard is None else args.shard
    x, y, x_test, y_test = load_shard(shard, args.world, args.data)
    model = make_model(seed=JOIN_SEED if args.join else INIT_SEED,
                       batchnorm=not args.no_batchnorm)
    inner = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    per_epoch = len(x) // args.batch  # whole batches only: BatchNorm needs more than one row
    total = args.epochs * per_epoch
    leave_at = round(total * args.leave_at) if args.leave_at > 0 else -1
    say(f"shard {shard}: {len(x)} samples, {len(x_test)} held out, {total} steps")
    socket = args.socket
    if socket == "-":  # torch is imported and the data loaded: joining takes no time at all
        say("ready, with fresh weights; waiting for a daemon to join the swarm through")
        socket = sys.stdin.readline().strip()
        if not socket:
            say("no daemon given: not joining")
            return 1
    # the swarm's peers are hosts: with --local-world, each host's trainers average as one
    peers = args.world // (args.local_world or 1)
    opt = moshpit.Optimizer(inner, client=socket, key="demo",
                            average_every=args.average_every, group_size=peers,
                            model=model, average_state=True, timeout=args.timeout,
                            local_world=args.local_world)
    if args.join:
        fresh = shard_loss(model, x, y)
        start = opt.load_state_from_peers(timeout=args.sync_timeout)
        say(f"joined: shard loss {fresh:.3f} with its own fresh weights, "
            f"{shard_loss(model, x, y):.3f} with the state downloaded from peers; "
            f"resuming at step {start}/{total}")
    else:  # the same initial weights everywhere, but a first collective round all the same
        synced = opt.sync(min_group_size=peers, timeout=args.sync_timeout)
        say(f"first round with everyone: {describe(opt, synced)}")
    show_rounds = args.rank == 0 or args.all_rounds
    first = opt.local_step
    parent, began = os.getppid(), time.monotonic()
    gen = torch.Generator().manual_seed(1000 + args.rank)
    while opt.local_step < total:
        epoch = opt.local_step // per_epoch
        order = torch.randperm(len(x), generator=gen)
        loss_sum, seen = 0.0, 0
        for i in range(opt.local_step % per_epoch, per_epoch):
            idx = order[i * args.batch:(i + 1) * args.batch]
            loss = loss_fn(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            done = opt.rounds_done  # failed rounds: moshpit logs a warning
            opt.step(batch_size=len(idx))
            loss_sum, seen = loss_sum + loss.item() * len(idx), seen + len(idx)
            step = opt.local_step
            if opt.rounds_done > done and show_rounds and opt.last_round is not None:
                say(f"round {opt.rounds_done} at step {step}/{total}: group of "
                    f"{opt.last_round.group_size}, {opt.last_round.seconds:.3f} s"
                    f"{local_ranks(opt.last_round)}")
            if step == leave_at:
                say(f"leaving: killed at step {step}/{total}")
                os.kill(os.getpid(), signal.SIGKILL)
            if os.getppid() != parent:  # the orchestrator died: nobody is listening any more
                raise SystemExit("orchestrator gone")
        say(f"epoch {epoch + 1}/{args.epochs} (step {opt.local_step}/{total}): loss "
            f"{loss_sum / max(seen, 1):.4f}, held-out accuracy "
            f"{accuracy(model, x_test, y_test):.4f}")
    # The last round waits for everyone, so that all trainers end with one model.
    synced = opt.sync(min_group_size=peers, timeout=args.sync_timeout)
    say(f"trained {total - first} steps in {time.monotonic() - began:.1f} s, "
        f"{opt.rounds_done} rounds ok, {opt.failed_rounds} failed; last round with everyone: "
        f"{describe(opt, synced)}; final accuracy {accuracy(model, x_test, y_test):.4f}")
    if args.local_world and args.rank % args.local_world == 0 and isinstance(opt.client,
                                                                             moshpit.Client):
        sizes = [r["group_size"] for r in opt.client.rounds() if r["key"] == "demo"]
        say(f"host {args.rank // args.local_world}: {len(sizes)} rounds under 'demo' as one "
            f"peer, group sizes {sorted(set(sizes))}")
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
    sys.exit(main())
