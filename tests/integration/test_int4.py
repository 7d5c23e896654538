"""Codec int4 between real daemons: the averaged result is within the codec's bound of the true
weighted mean, and the wire carries about 4.5 bits a value."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

import moshpit
from moshpitd.launcher import LocalSwarm
from tests.integration.helpers import run_parallel, weighted_mean

N = 400_003
BLOCK = 64


def window_max(x: np.ndarray) -> np.ndarray:
    """max |x| over [i - 63, i + 63]: it holds every block of 64 that contains element i,
    wherever the round's parts start."""
    padded = np.pad(np.abs(x), BLOCK - 1)
    return sliding_window_view(padded, 2 * BLOCK - 1).max(axis=1)


def test_int4_average_is_within_its_bound(swarm_factory: Callable[..., LocalSwarm]) -> None:
    swarm = swarm_factory(3)
    clients = [moshpit.Client(s) for s in swarm.sockets]
    gen = torch.Generator().manual_seed(5)
    # scales that differ by member and along the vector, so blocks have their own scales
    ramp = torch.logspace(-3, 1, N)
    xs = [torch.randn(N, generator=gen) * ramp * (i + 1) for i in range(3)]
    weights = [1.0, 2.0, 5.0]
    results = run_parallel([lambda i=i: clients[i].average([xs[i]], key="int4", weight=weights[i],
                                                           codec="int4", group_size=3,
                                                           timeout=30) for i in range(3)])
    exact = weighted_mean([x.numpy() for x in xs], weights)
    # each contribution is off by at most half its block's step (max |x| / 7); the owner's
    # result goes back int4 again, off by half a step of the mean's block, whose max is at
    # most the weighted mean of the members' maxima
    reach = weighted_mean([window_max(x.numpy()) for x in xs], weights)
    bound = 2 * 0.5 * reach / 7 * (1 + 1e-5)
    for i, r in enumerate(results):
        assert isinstance(r, list), r
        err = np.abs(r[0].numpy().astype(np.float64) - exact)
        print(f"member {i}: max error / bound = {(err / bound).max():.3f}, "
              f"mean |error| {err.mean():.2e}")
        assert (err <= bound).all(), (err / bound).max()
        assert (err > 0).any()  # it did go through the codec
        info = clients[i].last_round
        assert info is not None and info.group_size == 3 and info.fully_averaged
        # a member sends 2/3 of the vector and gets it back: 2 x 2/3 x 4.5 bits a value
        # (plus the contributions to its own third), against 32 bits uncompressed
        raw = 2 * (2 / 3) * N * 4 + 2 * 2 * N * 4 / 3
        assert info.bytes_sent + info.bytes_received < raw * 4.6 / 32, (info, raw)
