"""DiLoCo between real daemons: the outer step every trainer takes equals torch's own
SGD-Nesterov applied to the hand-computed weighted mean of the pseudo-gradients; streaming
fragments with int4 and error feedback sync each fragment under its own key, on schedule.

Trainers are threads of this process, each with its own daemon (a real process) and its own
model; their inner gradients are fixed random tensors, so every local step is known here."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import moshpit
from moshpitd.launcher import LocalSwarm
from tests.integration.helpers import run_parallel

SHAPES = [(1000,), (7, 3), (300,)]
LR_INNER = 0.1


def params() -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)  # the same start on every trainer
    return [nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def grads(rank: int, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return [torch.randn(s, generator=gen) * (1 + rank) for s in SHAPES]


def trainer(socket: str, rank: int, steps: int, batch: int, **kwargs: object
            ) -> moshpit.Optimizer:
    ps = params()
    inner = torch.optim.SGD(ps, lr=LR_INNER)
    outer = torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)
    opt = moshpit.Optimizer(inner, client=socket, key=str(kwargs.pop("key")),
                            outer_optimizer=outer, timeout=30.0, **kwargs)  # type: ignore[arg-type]
    for step in range(1, steps + 1):
        for p, g in zip(ps, grads(rank, step), strict=True):
            p.grad = g
        opt.step(batch_size=batch)
    opt.finish()
    return opt


def test_outer_step_is_torch_sgd_nesterov_on_the_weighted_mean(
        swarm_factory: Callable[..., LocalSwarm]) -> None:
    swarm = swarm_factory(3)
    every, syncs, batches = 3, 2, [1, 2, 5]
    opts = run_parallel([lambda r=r: trainer(swarm.sockets[r], r, every * syncs, batches[r],
                                             key="diloco", average_every=every,
                                             group_size=3, min_group_size=3)
                         for r in range(3)], timeout=180)
    # by hand: between syncs each trainer's local weights move by -lr * (sum of its
    # gradients) from the global copy, so its pseudo-gradient is lr * that sum
    ref = [p.detach().clone().requires_grad_(True) for p in params()]
    sgd = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=True)
    weights = [every * b for b in batches]  # samples since the last sync
    for k in range(syncs):
        steps = range(k * every + 1, (k + 1) * every + 1)
        pseudo = [[LR_INNER * sum(grads(r, s)[i] for s in steps) for i in range(len(SHAPES))]
                  for r in range(3)]
        for i, p in enumerate(ref):
            p.grad = sum(w * pseudo[r][i] for r, w in enumerate(weights)) / sum(weights)
        sgd.step()
    for opt in opts:
        assert isinstance(opt, moshpit.Optimizer), opt
        assert opt.rounds_done == syncs and opt.failed_rounds == 0, opt.last_error
        assert opt.last_round is not None and opt.last_round.group_size == 3
        assert opt.diloco is not None
        for g, want in zip(opt.diloco.global_params, ref, strict=True):
            torch.testing.assert_close(g.detach(), want.detach(), rtol=1e-5, atol=1e-5)
        # the outer optimizer's state is the reference's: momentum made the second step
        for g, want in zip(opt.diloco.global_params, ref, strict=True):
            torch.testing.assert_close(opt.diloco.outer.state[g]["momentum_buffer"],
                                       sgd.state[want]["momentum_buffer"], rtol=1e-5,
                                       atol=1e-5)
        opt.close()


def test_streaming_fragments_with_int4_and_error_feedback(
        swarm_factory: Callable[..., LocalSwarm]) -> None:
    swarm = swarm_factory(3)
    every, fragments, steps = 4, 2, 12  # fragment 0 syncs at 4, 8, 12; fragment 1 at 2, 6, 10
    opts = run_parallel([lambda r=r: trainer(swarm.sockets[r], r, steps, 1, key="stream",
                                             average_every=every, fragments=fragments,
                                             delay=1, codec="int4", group_size=3,
                                             min_group_size=3)
                         for r in range(3)], timeout=180)
    for opt in opts:
        assert isinstance(opt, moshpit.Optimizer), opt
        assert opt.rounds_done == 6 and opt.failed_rounds == 0, opt.last_error
        assert opt.diloco is not None and opt.diloco.feedback is not None
        assert set(opt.diloco.feedback.residual) == {0, 1, 2}  # every parameter carries one
    client = moshpit.Client(swarm.sockets[0])
    rounds = [r for r in client.rounds() if r["key"].startswith("stream/")]
    assert sorted(r["key"] for r in rounds) == ["stream/f0"] * 3 + ["stream/f1"] * 3
    assert all(r["result"] == "ok" and r["group_size"] == 3 for r in rounds), rounds
    # every trainer applied the same averaged pseudo-gradients (the owner of a span kept its
    # exact mean, the others got it compressed: the trainers compress it alike once more)
    first = opts[0].diloco.global_params if isinstance(opts[0], moshpit.Optimizer) else []
    for opt in opts[1:]:
        assert isinstance(opt, moshpit.Optimizer) and opt.diloco is not None
        for a, b in zip(first, opt.diloco.global_params, strict=True):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)
    for opt in opts:
        if isinstance(opt, moshpit.Optimizer):
            opt.close()
    client.close()


def test_joiner_downloads_the_global_copy_and_outer_state(
        swarm_factory: Callable[..., LocalSwarm]) -> None:
    """Two trainers sync twice and publish; a third, started from other weights, loads the
    global copy and the outer momentum from their daemons and resumes at their step."""
    swarm = swarm_factory(3)
    opts = run_parallel([lambda r=r: trainer(swarm.sockets[r], r, 4, 1, key="join",
                                             average_every=2, group_size=2, min_group_size=2)
                         for r in range(2)], timeout=180)
    donor = opts[0]
    assert isinstance(donor, moshpit.Optimizer) and donor.diloco is not None, donor
    assert donor.rounds_done == 2, donor.last_error
    torch.manual_seed(99)
    ps = [nn.Parameter(torch.randn(s)) for s in SHAPES]
    joiner = moshpit.Optimizer(torch.optim.SGD(ps, lr=LR_INNER), client=swarm.sockets[2],
                               key="join", average_every=2,
                               outer_optimizer=torch.optim.SGD(ps, lr=0.7, momentum=0.9,
                                                               nesterov=True))
    assert joiner.load_state_from_peers(timeout=30) == 4
    assert joiner.diloco is not None
    for g, want, p in zip(joiner.diloco.global_params, donor.diloco.global_params, ps,
                          strict=True):
        assert torch.equal(g.detach(), want.detach()) and torch.equal(p.detach(), g.detach())
        assert torch.equal(joiner.diloco.outer.state[g]["momentum_buffer"],
                           donor.diloco.outer.state[want]["momentum_buffer"])
    for opt in [*opts, joiner]:
        if isinstance(opt, moshpit.Optimizer):
            opt.close()
