"""Between real daemons (one swarm for the module): a member of weight 0 owns no span and gets
the weighted members' mean, and one that hangs holds nobody up; DiLoCo's outer step with a
robust aggregation, int4 and streaming fragments stays with the honest trainers when one
trainer's pseudo-gradient is huge.

Trainers are threads of this process, each with its own daemon (a real process) and model;
their inner gradients are fixed random tensors, so every pseudo-gradient is known here."""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from torch import nn

import moshpit
from moshpit.error_feedback import wire_values
from moshpitd.allreduce.codecs import get_codec
from moshpitd.launcher import LocalSwarm
from tests.integration.helpers import active_keys, run_parallel, wait_until, weighted_mean

SHAPES = [(700,), (13, 17), (400,), (90,)]  # two fragments: tensor 0, tensors 1-3
LR_INNER = 0.05
OUTLIER = 1000.0  # trainer 3's gradients are this much larger
HANG = 3  # the daemon that hangs as soon as it takes part in a round with weight 0


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    workdir = tmp_path_factory.mktemp("listeners")
    env = {"MOSHPITD_FAULT": "hang-listener", "MOSHPITD_FAULT_MARKER": str(workdir / "hung")}
    with LocalSwarm(4, workdir=workdir, env_by_index={HANG: env}) as s:
        yield s
        # with a peer gone each daemon takes ~1 s to stop: let them stop side by side
        for d in s.daemons:
            if d.alive():
                d.proc.terminate()


def bits(info: moshpit.RoundInfo, *peers: str) -> int:
    return sum(1 << info.members.index(p) for p in peers)


def test_a_weight_0_member_owns_no_span_and_gets_the_weighted_mean(swarm: LocalSwarm) -> None:
    clients = [moshpit.Client(s) for s in swarm.sockets[:3]]
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(10_000, generator=gen) for _ in range(3)]
    for weights in ([1.0, 3.0, 0.0], [0.0, 2.0, 0.0]):  # ... and only one weighted member
        key = f"listen-{weights[0]:g}"
        out = run_parallel([lambda c=c, x=x, w=w, k=key: c.average([x], key=k, weight=w,
                                                                   group_size=3,
                                                                   min_group_size=3,
                                                                   timeout=20)
                            for c, x, w in zip(clients, xs, weights, strict=True)])
        want = weighted_mean([x.numpy() for x in xs], weights)
        weighted = [c.peer_id for c, w in zip(clients, weights, strict=True) if w > 0]
        for c, r, w in zip(clients, out, weights, strict=True):
            assert isinstance(r, list), r
            np.testing.assert_allclose(r[0].numpy(), want, rtol=0, atol=1e-6)
            info = c.last_round
            assert info is not None and info.group_size == 3
            assert info.spans == ((0, 10_000, bits(info, *weighted)),)  # nobody else's values
            assert (info.owned == 0) == (w == 0), info.owned  # the listener reduced nothing
    for c in clients:
        c.close()


def grads(rank: int, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    scale = OUTLIER if rank == 3 else 1.0
    return [torch.randn(s, generator=gen) * scale for s in SHAPES]


def start() -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def outer_sgd(ps: list[torch.Tensor]) -> torch.optim.SGD:
    return torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)


def trainer(socket: str, rank: int, aggregation: str) -> moshpit.Optimizer:
    ps = start()
    opt = moshpit.Optimizer(torch.optim.SGD(ps, lr=LR_INNER), client=socket,
                            key=f"robust-{aggregation}", average_every=2, fragments=2,
                            codec="int4", aggregation=aggregation, group_size=4,
                            min_group_size=4, timeout=30.0, outer_optimizer=outer_sgd(ps))
    for step in range(1, 5):
        for p, g in zip(ps, grads(rank, step), strict=True):
            p.grad = g
        opt.step()
    opt.finish()
    return opt


def reference(fragments: list[list[int]], combine: str) -> list[torch.Tensor]:
    """The global copy by hand: each fragment's pseudo-gradients (inner SGD: lr x the sum of
    its gradients since its last sync) through error feedback and int4 as the trainers send
    them, combined, compressed once more as the result comes back, then torch's SGD-Nesterov.
    `combine`: "trimmed" (per element, the mean of the middle two of four: the trimmed mean
    of four equal weights drops one at each end), "honest" (trainers 0-2) or "mean"."""
    codec = get_codec("int4")
    ref = [p.detach().clone().requires_grad_(True) for p in start()]
    sgd = outer_sgd(ref)
    residual: dict[tuple[int, int], torch.Tensor] = {}
    last = [0, 0]
    for step in range(1, 5):
        p = step % 2  # fragment 1 syncs at steps 1 and 3, fragment 0 at 2 and 4
        since = range(last[p] + 1, step + 1)
        last[p] = step
        sent = []
        for r in range(4):
            wanted = [LR_INNER * sum(grads(r, s)[i] for s in since)
                      + residual.get((r, i), 0.0) for i in fragments[p]]
            quantized = wire_values(wanted, codec)
            for i, w, q in zip(fragments[p], wanted, quantized, strict=True):
                residual[(r, i)] = w - q
            sent.append(quantized)
        rows = [torch.stack([sent[r][j].double() for r in range(4)])
                for j in range(len(fragments[p]))]
        if combine == "trimmed":
            means = [row.sort(dim=0).values[1:3].mean(0) for row in rows]
        else:
            means = [row[:3].mean(0) if combine == "honest" else row.mean(0) for row in rows]
        back = wire_values([m.float() for m in means], codec)
        for g in ref:
            g.grad = None
        for i, m in zip(fragments[p], back, strict=True):
            ref[i].grad = m
        sgd.step()
    return [g.detach() for g in ref]


def distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return float(torch.sqrt(sum(((x.double() - y.double()) ** 2).sum()
                                for x, y in zip(a, b, strict=True))))


@pytest.mark.parametrize("aggregation", ["trimmed_mean", "centered_clip"])
def test_robust_outer_step_with_int4_and_fragments_ignores_a_huge_pseudo_gradient(
        swarm: LocalSwarm, aggregation: str) -> None:
    opts = run_parallel([lambda r=r: trainer(swarm.sockets[r], r, aggregation)
                         for r in range(4)], timeout=120)
    for opt in opts:
        assert isinstance(opt, moshpit.Optimizer) and opt.diloco is not None, opt
        assert opt.rounds_done == 4 and opt.failed_rounds == 0, opt.last_error
    first = opts[0].diloco
    fragments = first.fragments
    assert len(fragments) == 2
    client = moshpit.Client(swarm.sockets[0])
    keys = sorted(r["key"] for r in client.rounds() if r["key"].startswith(f"robust-"
                                                                              f"{aggregation}"))
    assert keys == [f"robust-{aggregation}/f0"] * 2 + [f"robust-{aggregation}/f1"] * 2
    client.close()
    got = [g.detach() for g in first.global_params]
    for opt in opts[1:]:  # every trainer applied the same update
        assert distance(got, [g.detach() for g in opt.diloco.global_params]) == 0.0
    honest, plain = reference(fragments, "honest"), reference(fragments, "mean")
    off = distance(got, honest) / distance(plain, honest)
    print(f"{aggregation}: distance to the honest update / the plain mean's = {off:.2e}")
    assert off < 0.01  # the plain mean is pulled OUTLIER / 4 times an honest step away
    if aggregation == "trimmed_mean":
        for g, want in zip(got, reference(fragments, "trimmed"), strict=True):
            torch.testing.assert_close(g, want, rtol=0, atol=1e-5)
    for opt in opts:
        opt.close()


def test_a_joiner_syncs_with_weight_0_owns_no_span_and_steps_like_everyone(
        swarm: LocalSwarm) -> None:
    """Two trainers sync twice per fragment and publish; a third loads their state at step 4
    and syncs fragment 1 with them at step 5, one step of its own (H = 2): weight 0. Its
    gradients are huge, so had they counted, the update would be far from the hand-computed
    one, which averages the other two only."""
    loaded, resumed = threading.Barrier(3), threading.Barrier(3)

    def make(socket: str, ps: list[nn.Parameter]) -> moshpit.Optimizer:
        return moshpit.Optimizer(torch.optim.SGD(ps, lr=LR_INNER), client=socket, key="join",
                                 average_every=2, fragments=2, group_size=3,
                                 min_group_size=2, timeout=30.0, outer_optimizer=outer_sgd(ps))

    def step(opt: moshpit.Optimizer, ps: list[nn.Parameter], rank: int, at: int) -> None:
        for p, g in zip(ps, grads(rank, at), strict=True):
            p.grad = g
        opt.step()

    def donor(rank: int) -> moshpit.Optimizer:
        ps = start()
        opt = make(swarm.sockets[rank], ps)
        for at in range(1, 5):
            step(opt, ps, rank, at)
        loaded.wait(60)  # the joiner downloads our state now
        resumed.wait(60)
        opt.min_group_size = 3  # step 5's round waits for the joiner
        step(opt, ps, rank, 5)
        opt.finish()
        return opt

    def joiner() -> tuple[moshpit.Optimizer, list[torch.Tensor], torch.optim.SGD]:
        ps = [nn.Parameter(torch.zeros(s)) for s in SHAPES]
        opt = make(swarm.sockets[2], ps)
        loaded.wait(60)
        assert opt.load_state_from_peers(timeout=30) == 4 and opt.diloco is not None
        # the reference: the global copy and outer state it downloaded, stepped by hand
        ref = [g.detach().clone().requires_grad_(True) for g in opt.diloco.global_params]
        sgd = outer_sgd(ref)
        sgd.load_state_dict(copy.deepcopy(opt.diloco.outer.state_dict()))  # not shared
        resumed.wait(60)
        opt.min_group_size = 3
        step(opt, ps, 3, 5)  # rank 3's gradients: OUTLIER times the others'
        opt.finish()
        return opt, ref, sgd

    *donors, joined = run_parallel([lambda: donor(0), lambda: donor(1), joiner], timeout=120)
    assert isinstance(joined, tuple), joined
    opt, ref, sgd = joined
    assert opt.diloco is not None and opt.failed_rounds == 0, opt.last_error
    fragment = opt.diloco.fragments[1]  # synced at steps 1, 3, 5: since step 3, two steps
    for g in ref:
        g.grad = None
    for i in fragment:
        ref[i].grad = sum(LR_INNER * (grads(r, 4)[i] + grads(r, 5)[i]) for r in (0, 1)) / 2
    sgd.step()
    info = opt.last_round
    assert info is not None and info.group_size == 3 and info.owned == 0, info
    ids = [moshpit.Client(s) for s in swarm.sockets[:2]]
    assert info.spans == ((0, sum(ref[i].numel() for i in fragment),
                           bits(info, *(c.peer_id for c in ids))),)  # the joiner's bit in none
    for c in ids:
        c.close()
    for d in donors:
        assert isinstance(d, moshpit.Optimizer) and d.diloco is not None, d
        assert d.rounds_done == 5 and d.last_round is not None and d.last_round.owned > 0
        for g, mine, want in zip(d.diloco.global_params, opt.diloco.global_params, ref,
                                 strict=True):
            assert torch.equal(g.detach(), mine.detach())  # every global copy alike
            torch.testing.assert_close(g.detach(), want.detach(), rtol=0, atol=1e-6)
        d.close()
    opt.close()


def test_a_weight_0_member_that_hangs_holds_nobody_up(swarm: LocalSwarm) -> None:
    """Its daemon stops dead as the round starts. Had it a span, the others would wait for it
    until their deadline (20 s away) and keep their own values there."""
    a, b, hung = (moshpit.Client(swarm.sockets[i]) for i in (0, 1, HANG))
    watch = [moshpit.Client(s) for s in swarm.sockets[:2]]  # a and b are busy averaging
    xa, xb = torch.full((50_000,), 1.0), torch.full((50_000,), 4.0)

    def weighted(c: moshpit.Client, x: torch.Tensor) -> object:
        return c.average([x], key="hang", weight=1.0, group_size=3, min_group_size=3,
                         timeout=20)

    def listener() -> object:
        # declared after a and b, so ranked after them: one of them leads (a leader that
        # hangs before its group info went out would be a matchmaking fault, not this one)
        wait_until(lambda: all("hang" in active_keys(w) for w in watch), 10,
                   "a and b matchmaking")
        return hung.average([torch.zeros(50_000)], key="hang", weight=0.0, group_size=3,
                            min_group_size=3, timeout=20)

    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(listener)
        out = run_parallel([lambda: weighted(a, xa), lambda: weighted(b, xb)], timeout=60)
        wait_until((swarm.workdir / "hung").exists, 10, "the listener's daemon hanging")
        swarm.daemons[HANG].kill()
        assert isinstance(pending.exception(60), moshpit.MoshpitError)
    for c, r in ((a, out[0]), (b, out[1])):
        assert isinstance(r, list), r
        assert torch.equal(r[0], torch.full((50_000,), 2.5))
        info = c.last_round
        assert info is not None and info.group_size == 3 and info.seconds < 5.0, info
        assert info.spans == ((0, 50_000, bits(info, a.peer_id, b.peer_id)),)
    assert [r["result"] for r in a.rounds() if r["key"] == "hang"] == ["ok"]
    for c in (a, b, hung, *watch):
        c.close()
