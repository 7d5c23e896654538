"""Robust aggregation with real daemons: 8 peers, one of them sends garbage.

Seven honest peers submit 1 + 0.01 N(0, 1) per element; the eighth submits 1e6 times its values
(`huge`) or -100 times them (`flip`). The vector (50 000 float32) is cut into 8 spans of 6 250
elements, one part each, and each reducer aggregates its part over the 8 contributions.

- `mean` lets the bad peer through: every honest peer ends up far from the honest mean
  (about 1.3e5 off per element for `huge`, 13 for `flip`).
- `trimmed_mean` (a quarter of the weight cut at each end; the bad peer holds 1/8) keeps every
  element between the honest peers' minimum and maximum there (measured: at most 0.01 off).
- `centered_clip`: with the bad share d = 1/8, the honest spread rho (largest distance of an
  honest part from the honest mean, about 0.75 here), the start v0 (coordinate-wise median),
  e0 = ||v0 - honest mean|| and tau = 2 x the median distance from v0 (about 1.54), robust.py's
      e' <= max(d (e + tau), e + (1 - d) rho - (1 - 2d) tau)
  iterated from e0 over the 10 iterations (or, stopped early, d tau / (1 - d) + 1e-6 tau)
  bounds the L2 error of every part, given tau >= rho (1 - d) / (1 - 2d), which the test checks
  on its data. Here the bound is about tau / 7 = 0.22 per part, so no element is off by more
  than that. Measured: the L2 error of a part sits at the bound (the clipped bad row keeps
  pulling with length tau, the fixed point is exactly tau / 7 away), spread over 6 250
  elements: the largest error of an element is 0.003, against 1.3e5 for the mean.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import moshpit
from moshpitd.allreduce.layout import TensorSpec, plan_parts, runs_of
from moshpitd.ipc.schema import AverageRequest
from moshpitd.launcher import LocalSwarm
from tests.integration.helpers import run_parallel

PEERS = 8
BAD = 7
ELEMS = 50_000
D = 1 / PEERS  # the bad peer's share of the weight
ATTACKS = {"huge": 1e6, "flip": -100.0}


def submitted(i: int, attack: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    x = 1 + 0.01 * torch.randn(ELEMS, generator=g)
    return x * ATTACKS[attack] if i == BAD else x


def parts() -> list[tuple[int, int]]:
    """The group's parts: equal bandwidths, the default 1 MiB part size -> one part per span."""
    runs = runs_of([TensorSpec("float32", (ELEMS,), 0)])
    return [(p.start, p.stop) for p in plan_parts(runs, [1.0] * PEERS)]


def cclip_bound(e0: float, rho: float, tau: float, iterations: int = 10) -> float:
    e = e0
    for _ in range(iterations):
        e = max(D * (e + tau), e + (1 - D) * rho - (1 - 2 * D) * tau)
    return max(e, D * tau / (1 - D) + 1e-6 * tau)


@pytest.fixture(scope="module")
def swarm8(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    swarm = LocalSwarm(PEERS, workdir=Path(tmp_path_factory.mktemp("robust")),
                       extra_args=["--bandwidth", "1"]).start()  # equal spans: parts()
    try:
        yield swarm
    finally:
        swarm.stop()


@pytest.fixture(scope="module")
def clients(swarm8: LocalSwarm) -> Iterator[list[moshpit.Client]]:
    cs = [moshpit.Client(s) for s in swarm8.sockets]
    yield cs
    for c in cs:
        c.close()


def one_round(clients: list[moshpit.Client], attack: str, aggregation: str
              ) -> tuple[np.ndarray, list[np.ndarray]]:
    """Everybody averages once; returns the stacked inputs and the honest peers' results."""
    inputs = [submitted(i, attack) for i in range(PEERS)]
    key = f"robust-{attack}-{aggregation}"
    results = run_parallel([
        lambda i=i: clients[i].average([inputs[i]], key=key, timeout=30, group_size=PEERS,
                                       min_group_size=PEERS, aggregation=aggregation)
        for i in range(PEERS)])
    for r in results:
        assert not isinstance(r, Exception), r
    for c in clients:
        assert c.last_round is not None and c.last_round.group_size == PEERS
        assert c.last_round.fully_averaged, c.last_round
    outs = [results[i][0].numpy().astype(np.float64) for i in range(PEERS) if i != BAD]
    for out in outs[1:]:  # every peer gets the same reduced parts back
        np.testing.assert_array_equal(out, outs[0])
    return np.stack([t.numpy().astype(np.float64) for t in inputs]), outs


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_mean_lets_the_bad_peer_through(clients: list[moshpit.Client], attack: str) -> None:
    x, outs = one_round(clients, attack, "mean")
    honest_mean = np.delete(x, BAD, axis=0).mean(axis=0)
    np.testing.assert_allclose(outs[0], x.mean(axis=0), rtol=1e-6)
    assert np.abs(outs[0] - honest_mean).min() > 10.0


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_trimmed_mean_stays_within_the_honest_range(clients: list[moshpit.Client],
                                                    attack: str) -> None:
    x, outs = one_round(clients, attack, "trimmed_mean")
    honest = np.delete(x, BAD, axis=0)
    slack = 1e-6  # the result is rounded to float32
    assert (outs[0] >= honest.min(axis=0) - slack).all()
    assert (outs[0] <= honest.max(axis=0) + slack).all()
    assert np.abs(outs[0] - honest.mean(axis=0)).max() < 0.03


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_centered_clip_within_its_bound(clients: list[moshpit.Client], attack: str) -> None:
    x, outs = one_round(clients, attack, "centered_clip")
    honest = np.delete(x, BAD, axis=0)
    for lo, hi in parts():
        part, mean = x[:, lo:hi], honest[:, lo:hi].mean(axis=0)
        rho = float(np.linalg.norm(honest[:, lo:hi] - mean, axis=1).max())
        start = np.median(part, axis=0)
        tau = 2.0 * float(np.median(np.linalg.norm(part - start, axis=1)))
        assert tau >= rho * (1 - D) / (1 - 2 * D), (tau, rho)  # the bound's condition
        bound = cclip_bound(float(np.linalg.norm(start - mean)), rho, tau)
        assert bound < 0.3  # the stated tau / 7, about 0.22
        # + 1e-5: float32 rounding of the result, at most 6e-8 per element over 6 250 of them
        err = float(np.linalg.norm(outs[0][lo:hi] - mean))
        assert err <= bound + 1e-5, (lo, err, bound)
        assert np.abs(outs[0][lo:hi] - mean).max() <= bound + 1e-5


def test_peers_with_another_aggregation_do_not_group(clients: list[moshpit.Client]) -> None:
    values = [torch.full((1000,), float(i)) for i in range(3)]
    aggs = ["centered_clip", "centered_clip", "mean"]
    results = run_parallel([
        lambda i=i: clients[i].average([values[i]], key="robust-mismatch",
                                       timeout=20 if i < 2 else 5, group_size=3,
                                       aggregation=aggs[i])
        for i in range(3)])
    for i in range(2):
        assert not isinstance(results[i], Exception), results[i]
        assert clients[i].last_round is not None and clients[i].last_round.group_size == 2
        np.testing.assert_allclose(results[i][0].numpy(), 0.5)
    assert isinstance(results[2], moshpit.SchemaMismatch), results[2]
    assert "aggregation" in str(results[2])


def test_unknown_aggregation_is_refused_on_both_sides(clients: list[moshpit.Client]) -> None:
    with pytest.raises(ValueError, match="trimmed_mean"):
        clients[0].average([torch.ones(4)], key="robust-bad", aggregation="median")
    client = clients[0]  # past the client's own check, straight to the daemon
    with pytest.raises(moshpit.InvalidRequest, match="'aggregation' is 'median'"):
        client._request(AverageRequest(key="robust-bad", buffer=0,
                                       tensors=[["float32", [4], 0]], aggregation="median"),
                        timeout=10)
