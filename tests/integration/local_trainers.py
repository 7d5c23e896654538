"""Trainer processes for the local-group tests: each connects to its daemon, averages once and
sends back what it got or the error, so that a test can SIGKILL one while it waits."""

from __future__ import annotations

import dataclasses
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.forkserver
from typing import Any

import numpy as np

import moshpit
from tests.integration.helpers import wait_until

_FORKS: multiprocessing.context.ForkServerContext | None = None


def context() -> multiprocessing.context.ForkServerContext:
    """Trainers fork from a server that imported torch, torch._dynamo (the first optimizer
    step imports it) and moshpit once: seconds of CPU that each trainer would spend again."""
    global _FORKS
    if _FORKS is None:
        _FORKS = multiprocessing.get_context("forkserver")
        _FORKS.set_forkserver_preload(["torch", "torch._dynamo", "moshpit"])
        multiprocessing.forkserver.ensure_running()
    return _FORKS


def _main(conn: multiprocessing.connection.Connection, socket: str, arrays: list[np.ndarray],
          kwargs: dict[str, Any]) -> None:
    import torch

    with moshpit.Client(socket) as client:
        try:
            out = client.average([torch.from_numpy(a) for a in arrays], **kwargs)
        except moshpit.MoshpitError as exc:
            conn.send(("error", type(exc).__name__, str(exc), getattr(exc, "rank", None)))
            return
        assert client.last_round is not None
        conn.send(("ok", [t.numpy() for t in out], dataclasses.asdict(client.last_round)))


class Trainer:
    """One trainer process averaging `arrays` once through `socket`."""

    def __init__(self, socket: str, arrays: list[np.ndarray], **kwargs: Any) -> None:
        ctx = context()
        self.conn, child = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_main, args=(child, socket, arrays, kwargs), daemon=True)
        self.proc.start()
        child.close()

    def result(self, timeout: float = 60.0) -> tuple[Any, ...]:
        if not self.conn.poll(timeout):
            raise AssertionError(f"trainer {self.proc.pid} sent nothing within {timeout} s")
        out: tuple[Any, ...] = self.conn.recv()
        self.proc.join(10)
        return out

    def averaged(self, timeout: float = 60.0) -> tuple[list[np.ndarray], dict[str, Any]]:
        """The tensors and the RoundInfo (as a dict) of a round that must have succeeded."""
        got = self.result(timeout)
        assert got[0] == "ok", got
        return got[1], got[2]

    def failed(self, timeout: float = 60.0) -> tuple[str, str, int | None]:
        """(error class name, message, rank) of a round that must have failed."""
        got = self.result(timeout)
        assert got[0] == "error", got[:1]
        return got[1], got[2], got[3]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)


def local_ranks(client: moshpit.Client, key: str) -> list[int] | None:
    """The ranks in the daemon's local group under `key` now (None: no group)."""
    group = client.status()["status"]["local_groups"].get(key)
    return None if group is None else list(group["ranks"])


def wait_ranks(client: moshpit.Client, key: str, ranks: list[int], timeout: float = 20.0
               ) -> None:
    wait_until(lambda: local_ranks(client, key) == ranks, timeout,
               f"local group {key!r} holding ranks {ranks}")


def _diloco_main(conn: multiprocessing.connection.Connection, socket: str,
                 init: list[np.ndarray], grads: list[list[np.ndarray]], batch: int,
                 kwargs: dict[str, Any]) -> None:
    """DiLoCo with plain SGD inside (lr 0.1) and outside (lr 1): after one sync the global
    copy is its start minus the group's weighted mean of 0.1 x the gradients' sum."""
    import torch

    params = [torch.nn.Parameter(torch.from_numpy(a.copy())) for a in init]
    opt = moshpit.Optimizer(torch.optim.SGD(params, lr=0.1), client=socket,
                            outer_optimizer=torch.optim.SGD(params, lr=1.0),
                            average_every=len(grads), timeout=30.0, group_size=2, **kwargs)
    for step in grads:
        for p, g in zip(params, step, strict=True):
            p.grad = torch.from_numpy(g)
        opt.step(batch_size=batch)
    opt.finish()
    assert opt.diloco is not None
    conn.send((opt.rounds_done, repr(opt.last_error),
               [g.detach().numpy() for g in opt.diloco.global_params],
               None if opt.last_round is None else dataclasses.asdict(opt.last_round)))
    opt.close()


def diloco_trainer(socket: str, init: list[np.ndarray], grads: list[list[np.ndarray]],
                   batch: int, **kwargs: Any) -> Trainer:
    """A trainer process running moshpit.Optimizer in DiLoCo mode for one sync."""
    trainer = Trainer.__new__(Trainer)
    ctx = context()
    trainer.conn, child = ctx.Pipe(duplex=False)
    trainer.proc = ctx.Process(target=_diloco_main, args=(child, socket, init, grads, batch,
                                                          kwargs), daemon=True)
    trainer.proc.start()
    child.close()
    return trainer
