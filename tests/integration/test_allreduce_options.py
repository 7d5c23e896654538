"""Codecs, spans sized by declared bandwidth and client-mode peers, with real daemons."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import moshpit
from moshpitd.allreduce.spans import optimal_shares
from moshpitd.launcher import LocalSwarm, start_daemon
from tests.integration.helpers import run_parallel

N = 3_000_000


def inputs(i: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(i))


@pytest.mark.parametrize(("codec", "bound"), [("fp16", 2e-3), ("bf16", 1.6e-2), ("int8", 4e-2)])
def test_codec_round_error_is_bounded(swarm4: LocalSwarm, codec: str, bound: float) -> None:
    clients = [moshpit.Client(s) for s in swarm4.sockets]
    xs = [inputs(i) for i in range(4)]
    exact = torch.stack(xs).double().mean(0)
    results = run_parallel([lambda i=i: clients[i].average([xs[i]], key=f"c-{codec}",
                                                           codec=codec, group_size=4, timeout=30)
                            for i in range(4)])
    for i, r in enumerate(results):
        assert not isinstance(r, Exception), r
        err = (r[0].double() - exact).abs().max().item()
        print(f"{codec}: max abs error {err:.2e} (values ~N(0,1), mean of 4)")
        assert err <= bound, (codec, err)
        info = clients[i].last_round
        assert info is not None and info.bytes_sent < 3 * N * 4 * 2 * 0.6  # it compressed


def test_mismatched_codec_is_refused(swarm_factory: Callable[..., LocalSwarm]) -> None:
    swarm = swarm_factory(2)
    a, b = (moshpit.Client(s) for s in swarm.sockets)
    r = run_parallel([lambda: a.average([torch.ones(8)], key="mix", codec="fp16", timeout=4),
                      lambda: b.average([torch.ones(8)], key="mix", codec="none", timeout=4)])
    assert all(isinstance(x, moshpit.SchemaMismatch) for x in r), r


def test_bandwidth_shares_and_client_mode(swarm_factory: Callable[..., LocalSwarm]) -> None:
    swarm = swarm_factory(1, extra_args=["--bandwidth", "1"])  # declared: nothing measured
    boot = [swarm.daemons[0].dht]
    fast = start_daemon("fast", swarm.workdir, boot, extra_args=["--bandwidth", "3"])
    natted = start_daemon("nat", swarm.workdir, boot, extra_args=["--client-mode"])
    swarm.daemons += [fast, natted]
    clients = [moshpit.Client(d.socket) for d in swarm.daemons]
    xs = [inputs(10 + i) for i in range(3)]
    results = run_parallel([lambda i=i: clients[i].average([xs[i]], key="bw", group_size=3,
                                                           timeout=30) for i in range(3)])
    exact = torch.stack(xs).double().mean(0)
    for r in results:
        assert not isinstance(r, Exception), r
        assert (r[0].double() - exact).abs().max().item() < 1e-5
    owned = [c.last_round.owned for c in clients]  # type: ignore[union-attr]
    assert owned[2] == 0, owned  # a client-mode peer reduces nothing
    assert sum(owned) == N
    # spans minimise the round's time at the declared rates (allreduce/spans.py)
    rates = [1.0, 3.0, 1.0]
    expected = optimal_shares(rates, rates, [True] * 3, [True, True, False])
    assert owned[1] > owned[0], owned
    assert abs(owned[1] - expected[1] * N) <= 1, (owned, expected)
