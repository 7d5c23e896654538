"""One Moshpit SGD trainer of bench.training, plus the training loop bench.ddp_worker shares.

Protocol (JSON lines on stdout, one `go` line on stdin): the worker loads its shard and builds
its model and optimizer, prints {"event": "ready"}, waits for `go`, then trains and prints one
{"event": "epoch"} per epoch and {"event": "done"} at the end, or {"event": "error"} when
training cannot go on. Times are `time.monotonic()`, one clock for every process of the host,
so the orchestrator subtracts the moment it sent `go`. The rank chosen with --kill-rank prints
{"event": "kill"} after --kill-epoch and SIGKILLs itself: a deterministic crash.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import moshpit
from demo.model import accuracy, load_shard, make_model

Shard = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def common_parser(description: str | None) -> argparse.ArgumentParser:
    """Arguments every trainer of the benchmark takes, whatever synchronizes it."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--peers", type=int, required=True)
    p.add_argument("--data", required=True, help="split saved by demo.model.save_split")
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--kill-rank", type=int, default=-1, help="this rank SIGKILLs itself ...")
    p.add_argument("--kill-epoch", type=int, default=0, help="... after this many epochs")
    return p


def wait_for_go() -> None:
    """Blocks until the orchestrator says go; EOF (it went away) ends the process quietly."""
    if sys.stdin.readline().strip() != "go":
        raise SystemExit(0)


def train(args: argparse.Namespace, shard: Shard, forward: nn.Module, model: nn.Module,
          optimizer: Any, step: Callable[[int], None], evaluate: bool,
          stats: Callable[[], dict[str, Any]] | None = None) -> None:
    """--epochs passes over the shard in shuffled mini-batches; one event per epoch.

    `forward` is what the batches go through (the DDP wrapper or the model itself), `model`
    what is evaluated; `step(n)` takes the optimizer step for a batch of n samples."""
    x, y, x_test, y_test = shard
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(1000 + args.rank)
    parent = os.getppid()
    for epoch in range(1, args.epochs + 1):
        loss_sum = 0.0
        for idx in torch.randperm(len(x), generator=gen).split(args.batch):
            optimizer.zero_grad()
            loss = loss_fn(forward(x[idx]), y[idx])
            loss.backward()
            step(len(idx))
            loss_sum += loss.item() * len(idx)
        emit("epoch", epoch=epoch, t=time.monotonic(), loss=loss_sum / len(x),
             acc=accuracy(model, x_test, y_test) if evaluate else None,
             **(stats() if stats else {}))
        if args.rank == args.kill_rank and epoch == args.kill_epoch:
            emit("kill", epoch=epoch, t=time.monotonic())
            os.kill(os.getpid(), signal.SIGKILL)
        if os.getppid() != parent:  # the orchestrator died: nobody is listening any more
            raise SystemExit("orchestrator gone")
    emit("done", t=time.monotonic(), acc=accuracy(model, x_test, y_test) if evaluate else None,
         **(stats() if stats else {}))


def main(argv: list[str] | None = None) -> int:
    p = common_parser(__doc__)
    p.add_argument("--socket", required=True, help="IPC socket of this trainer's moshpitd")
    p.add_argument("--key", required=True)
    p.add_argument("--average-every", type=int, required=True)
    p.add_argument("--group-size", type=int, required=True)
    p.add_argument("--timeout", type=float, default=10.0, help="per-round timeout")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    shard = load_shard(args.rank, args.peers, args.data)
    model = make_model()  # the same seed everywhere: every trainer starts from one model
    client = moshpit.Client(args.socket)
    opt = moshpit.Optimizer(torch.optim.Adam(model.parameters(), lr=args.lr), client=client,
                            key=args.key, average_every=args.average_every,
                            group_size=args.group_size, model=model, timeout=args.timeout)
    groups: Counter[int] = Counter()  # group size -> successful rounds
    seconds = {"round": 0.0, "matchmaking": 0.0}  # summed over successful rounds, daemon-side

    def step(n: int) -> None:
        before = opt.rounds_done
        opt.step(batch_size=n)  # the weight of this peer in a round: samples since the last
        if opt.rounds_done > before and opt.last_round is not None:
            groups[opt.last_round.group_size] += 1
            seconds["round"] += opt.last_round.seconds
            seconds["matchmaking"] += opt.last_round.matchmaking_seconds

    def stats() -> dict[str, Any]:
        return {"rounds": opt.rounds_done, "failed_rounds": opt.failed_rounds,
                "groups": {str(k): v for k, v in sorted(groups.items())},
                "round_seconds": seconds["round"],
                "matchmaking_seconds": seconds["matchmaking"],
                "last_error": None if opt.last_error is None else
                f"{type(opt.last_error).__name__}: {opt.last_error}"}

    emit("ready", t=time.monotonic())
    wait_for_go()
    try:
        train(args, shard, model, model, opt, step, evaluate=True, stats=stats)
    finally:
        opt.close()
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
