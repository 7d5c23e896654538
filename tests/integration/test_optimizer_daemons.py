"""moshpit.Optimizer with real daemons, beyond convergence: a daemon restart survived, grid rounds
reaching the exact mean, and optimizer state averaged through the daemons."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import moshpit
from moshpitd.launcher import LocalSwarm, start_daemon
from tests.integration.helpers import run_parallel

WORLD = 4


def test_daemon_restart_is_survived_and_reconnected(
        swarm_factory: Callable[..., LocalSwarm]) -> None:
    """The trainer's daemon dies: the round fails without raising, training goes on, and once
    a daemon is back on the socket the next round reconnects and averages again."""
    swarm = swarm_factory(2)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = moshpit.Optimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                            client=moshpit.Client(swarm.sockets[1]), key="restart",
                            average_every=1, group_size=2, timeout=15.0)
    partner = moshpit.Client(swarm.sockets[0])
    partner_params = [torch.full((2, 4), 3.0), torch.full((2,), 3.0)]

    def round_with_partner() -> list[torch.Tensor]:
        model.weight.grad = torch.zeros_like(model.weight)
        model.bias.grad = torch.zeros_like(model.bias)
        out = run_parallel([lambda: partner.average(partner_params, key="restart", weight=1.0,
                                                    timeout=15.0, group_size=2),
                            lambda: opt.step(batch_size=1)])
        assert not isinstance(out[0], Exception), out[0]
        assert out[1] is None, out[1]
        return list(out[0])

    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(1.0)
    result = round_with_partner()
    assert opt.rounds_done == 1 and torch.equal(result[0], torch.full((2, 4), 2.0))
    assert torch.equal(model.weight.detach(), torch.full((2, 4), 2.0))

    workdir = swarm.daemons[1].workdir
    swarm.daemons[1].stop()
    opt.step(batch_size=1)  # no daemon: counted, logged, local values kept
    assert opt.failed_rounds == 1 and isinstance(opt.last_error, moshpit.DaemonUnavailable)
    assert torch.equal(model.weight.detach(), torch.full((2, 4), 2.0))
    opt.step(batch_size=1)  # still none: the reconnect fails quietly too
    assert opt.failed_rounds == 2

    swarm.daemons[1] = start_daemon("d1", workdir, [swarm.daemons[0].dht])
    assert swarm.daemons[1].socket == swarm.sockets[1]
    partner_params = [torch.full((2, 4), 4.0), torch.full((2,), 4.0)]
    result = round_with_partner()  # weight 3 (three steps since the last success) vs 1
    assert opt.rounds_done == 2 and opt.failed_rounds == 2
    assert torch.equal(model.weight.detach(), torch.full((2, 4), (3 * 2.0 + 4.0) / 4))
    partner.close()
    opt.close()


def test_grid_rounds_reach_the_exact_mean(swarm4: LocalSwarm) -> None:
    """On a full 2x2 grid, two rounds (one per axis) give every peer the exact mean, here
    through the optimizer: lr 0, so the parameters only move by averaging. (Equal batches: each
    round weighs a peer by its new samples, not by the mass its line carries, so unequal ones
    would give another, still convex, combination.)"""
    params = [[torch.nn.Parameter(torch.full((3, 5), float(r))), torch.nn.Parameter(
        torch.full((7,), -2.0 * r))] for r in range(WORLD)]
    opts = [moshpit.Optimizer(torch.optim.SGD(params[r], lr=0.0),
                              client=moshpit.Client(swarm4.sockets[r]), key="grid",
                              average_every=1, grid=(2, 2), initial_coords=(r // 2, r % 2),
                              timeout=20.0)
            for r in range(WORLD)]

    def two_steps(r: int) -> None:
        for _ in range(2):
            for p in params[r]:
                p.grad = torch.zeros_like(p)
            opts[r].step(batch_size=8)

    out = run_parallel([lambda r=r: two_steps(r) for r in range(WORLD)])
    assert all(o is None for o in out), out
    mean0 = sum(range(WORLD)) / WORLD
    for r, opt in enumerate(opts):
        assert opt.rounds_done == 2 and opt.failed_rounds == 0, opt.last_error
        assert opt.last_round is not None and opt.last_round.group_size == 2
        assert opt.last_round.coords == (r // 2, r % 2)
        torch.testing.assert_close(params[r][0].detach(), torch.full((3, 5), mean0))
        torch.testing.assert_close(params[r][1].detach(), torch.full((7,), -2.0 * mean0))
        opt.close()


@pytest.mark.parametrize(("make_inner", "state_keys"), [
    (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
     ("momentum_buffer",)),
    (lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1), ("exp_avg", "exp_avg_sq")),
], ids=["sgd-nesterov", "adamw"])
def test_optimizer_state_averaged_through_daemons(
        swarm_factory: Callable[..., LocalSwarm],
        make_inner: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
        state_keys: tuple[str, ...]) -> None:
    """3 peers, a round every 2 steps, average_state=True, unequal batches. Plain torch
    optimizers fed the same gradients (shadows) hold each peer's values before a round: after
    it, parameters and state buffers are one value on every peer, the samples-weighted mean of
    the shadows'. Two rounds with other batches: the weight counts samples since the last one."""
    peers = 3
    swarm = swarm_factory(peers)

    def init(r: int) -> list[torch.nn.Parameter]:
        g = torch.Generator().manual_seed(r)
        return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((4, 3), (5,))]

    live, shadow = [init(r) for r in range(peers)], [init(r) for r in range(peers)]
    shadow_opts = [make_inner(s) for s in shadow]
    opts = [moshpit.Optimizer(make_inner(live[r]), client=moshpit.Client(swarm.sockets[r]),
                              key="state", average_every=2, group_size=peers,
                              min_group_size=peers, average_state=True, timeout=20.0)
            for r in range(peers)]

    def averaged(params: list[torch.nn.Parameter],
                 opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [*params, *(opt.state[p][k] for p in params for k in state_keys)]

    gen = torch.Generator().manual_seed(99)
    for batches in ([1, 2, 5], [3, 1, 1]):
        for _ in range(2):
            for r in range(peers):
                for p, s in zip(live[r], shadow[r], strict=True):
                    p.grad = torch.randn(p.shape, generator=gen)
                    s.grad = p.grad.clone()
                shadow_opts[r].step()
            out = run_parallel([lambda r=r, b=b: opts[r].step(batch_size=b)
                                for r, b in enumerate(batches)])
            assert all(o is None for o in out), out
        weights = [2.0 * b for b in batches]
        before = [[t.detach().clone() for t in averaged(shadow[r], shadow_opts[r])]
                  for r in range(peers)]
        for opt in opts:
            assert opt.failed_rounds == 0, opt.last_error
            assert opt.last_round is not None and opt.last_round.group_size == peers
        for k in range(len(before[0])):
            want = sum(w * b[k].double() for w, b in zip(weights, before, strict=True))
            want = (want / sum(weights)).float()
            assert not any(torch.allclose(b[k], want) for b in before)  # averaging moved it
            got = [averaged(live[r], opts[r].optimizer)[k].detach() for r in range(peers)]
            assert all(torch.equal(g, got[0]) for g in got), k  # one value on every peer
            torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-6)
        with torch.no_grad():  # the shadows take the round's result, as the peers did
            for r in range(peers):
                for s, t in zip(averaged(shadow[r], shadow_opts[r]),
                                averaged(live[r], opts[r].optimizer), strict=True):
                    s.copy_(t)
    assert [opt.rounds_done for opt in opts] == [2] * peers
    for opt in opts:
        opt.close()
