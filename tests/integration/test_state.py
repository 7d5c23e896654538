"""Live state for joiners: published by trainers, served by daemons, downloaded from several."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

import moshpit
from moshpitd.launcher import LocalSwarm


def state(seed: int, big: int = 1000) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(big, generator=g), torch.randn(3, 5, generator=g, dtype=torch.float64),
            torch.arange(7, dtype=torch.float16)]


def test_download_from_donors_and_clear_error_without_any(
        swarm_factory: Callable[..., LocalSwarm]) -> None:
    swarm = swarm_factory(3)
    a, b, joiner = (moshpit.Client(s) for s in swarm.sockets)
    with pytest.raises(moshpit.StateUnavailable, match="no donor"):
        joiner.download_state("run", timeout=1.0)
    a.publish_state("run", state(1), {"step": 41})
    time.sleep(0.01)
    b.publish_state("run", state(2), {"step": 42})  # the latest version wins
    tensors, meta = joiner.download_state("run", timeout=10)
    assert meta == {"step": 42}
    for got, want in zip(tensors, state(2), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def test_dead_donor_is_replaced_without_starting_over(
        swarm_factory: Callable[..., LocalSwarm]) -> None:
    swarm = swarm_factory(4)
    clients = [moshpit.Client(s) for s in swarm.sockets]
    big = 24 << 20  # 96 MiB of float32: several ranges per donor
    published = state(7, big)
    for c in clients[:3]:  # three donors of one version (the same step)
        assert c.publish_state("big", published, {"step": 7}, version=7) == 7
    joiner = clients[3]
    swarm.daemons[0].kill()  # a donor that is dead before the download starts
    killer = threading.Timer(0.05, swarm.daemons[1].kill)  # and one that dies mid-way
    killer.start()
    tensors, meta = joiner.download_state("big", timeout=30)
    killer.join()
    assert meta == {"step": 7}
    for got, want in zip(tensors, published, strict=True):
        assert torch.equal(got, want)
    assert swarm.daemons[3].alive()
    log = swarm.daemons[3].log_path.read_text()
    assert "its range moves on" in log  # a dead donor's range went to another donor
