"""One demo trainer: local steps on its shard, parameters averaged through its daemon.

Run by demo.run as a separate process (never forked: torch threads and the client's socket do
not survive fork). Lines go to stdout prefixed with the rank; demo.run parses the last one.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn

import moshpit
from demo.model import accuracy, load_shard, make_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--socket", required=True, help="IPC socket of this trainer's moshpitd")
    p.add_argument("--data", help="split saved by demo.run (default: load it with sklearn)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--average-every", type=int, default=5, help="local steps between rounds")
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--max-failures", type=int, default=3,
                   help="stop averaging after this many failed rounds in a row")
    p.add_argument("--all-rounds", action="store_true",
                   help="print every round on every rank (default: rank 0 only)")
    return p.parse_args(argv)


class Averager:
    """Averages the model, and the step counter, through the daemon.

    A trainer left out of a round waits for the others' next one and so falls a round behind;
    adopting the group's (rounded up) mean step lets it catch up instead of averaging its last
    round alone until the timeout. A failed round is reported and training goes on; after
    --max-failures in a row it stops trying, so a broken daemon cannot stall the demo."""

    def __init__(self, args: argparse.Namespace, model: nn.Module,
                 say: Callable[[str], None]) -> None:
        self.args, self.model, self.say = args, model, say
        self.client = moshpit.Client(args.socket)
        self.rounds = self.failures = self.streak = 0
        self.samples = 0  # since the last successful round: the weight of our contribution

    @property
    def ok(self) -> int:
        return self.rounds - self.failures

    def __call__(self, step: int, min_group_size: int = 2) -> int:
        """One round at `step`; returns the step to continue from."""
        if self.streak >= self.args.max_failures:
            return step
        params = list(self.model.parameters())
        self.rounds += 1
        tensors = [p.detach() for p in params] + [torch.tensor([float(step)])]
        try:
            *averaged, mean_step = self.client.average(
                tensors, key="demo", weight=float(max(self.samples, 1)),
                timeout=self.args.timeout, group_size=self.args.world,
                min_group_size=min_group_size)
        except moshpit.MoshpitError as exc:
            self.failures += 1
            self.streak += 1
            self.say(f"round {self.rounds} (step {step}) failed, training on: {exc}")
            if self.streak >= self.args.max_failures:
                self.say(f"{self.streak} failed rounds in a row: no more averaging")
            return step
        with torch.no_grad():
            for p, new in zip(params, averaged, strict=True):
                p.copy_(new)
        self.samples = self.streak = 0
        every = self.args.average_every
        caught_up = max(step, math.ceil(float(mean_step) / every - 1e-3) * every)
        info = self.client.last_round
        if info is not None and (self.args.rank == 0 or self.args.all_rounds):
            self.say(f"round {self.rounds} (step {step}): group of {info.group_size}, "
                     f"{info.seconds:.3f} s ({info.matchmaking_seconds:.3f} s matchmaking)")
        if caught_up != step:
            self.say(f"round {self.rounds}: behind the group, skipping to step {caught_up}")
        return caught_up


def batches(n: int, batch: int, gen: torch.Generator) -> Iterator[torch.Tensor]:
    """Endless shuffled mini-batches of indices into a shard of n samples."""
    while True:
        order = torch.randperm(n, generator=gen)
        for i in range(0, n, batch):
            yield order[i:i + batch]


def train(args: argparse.Namespace, say: Callable[[str], None]) -> None:
    torch.set_num_threads(1)  # 4 trainers and 4 daemons share two cores
    x, y, x_test, y_test = load_shard(args.rank, args.world, args.data)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    steps_per_epoch = math.ceil(len(x) / args.batch)
    total = args.epochs * steps_per_epoch
    say(f"{len(x)} training samples, {len(x_test)} held out, {total} steps")
    average = Averager(args, model, say)
    # All ranks start together: a first round that waits for everyone (weights are identical).
    average(0, min_group_size=args.world)
    parent, step, epoch, start = os.getppid(), 0, 0, time.monotonic()
    loss_sum, seen = 0.0, 0
    for idx in batches(len(x), args.batch, torch.Generator().manual_seed(1000 + args.rank)):
        opt.zero_grad()
        loss = loss_fn(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        loss_sum, seen = loss_sum + loss.item() * len(idx), seen + len(idx)
        average.samples += len(idx)
        step += 1
        if step >= total:  # the last round waits for everyone, so all end with one model
            step = average(step, min_group_size=args.world)
        elif step % args.average_every == 0:
            step = average(step)
        if step // steps_per_epoch > epoch or step >= total:
            epoch = min(step // steps_per_epoch, args.epochs)
            say(f"epoch {epoch}/{args.epochs}: loss {loss_sum / max(seen, 1):.4f}, held-out "
                f"accuracy {accuracy(model, x_test, y_test):.4f} ({average.ok} rounds ok, "
                f"{average.failures} failed)")
            loss_sum, seen = 0.0, 0
        if step >= total:
            break
        if os.getppid() != parent:  # the orchestrator died: nobody is listening any more
            raise SystemExit("orchestrator gone")
    say(f"done in {time.monotonic() - start:.1f} s; final accuracy "
        f"{accuracy(model, x_test, y_test):.4f}, {average.ok} rounds ok")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def say(msg: str) -> None:
        print(f"[rank {args.rank}] {msg}", flush=True)

    try:
        train(args, say)
    except KeyboardInterrupt:
        return 130
    except moshpit.MoshpitError as exc:  # cannot even connect: nothing to demonstrate
        say(f"giving up: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
