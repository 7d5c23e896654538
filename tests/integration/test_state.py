"""Live state for joiners: published by trainers, served by daemons, downloaded from several."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import moshpit
from moshpitd.ipc.schema import Message
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
    older = a.publish_state("run", state(1), {"step": 41})  # versioned by a's clock
    newer = b.publish_state("run", state(2), {"step": 42}, version=older + 1)
    assert newer == older + 1
    tensors, meta = joiner.download_state("run", timeout=10)
    assert meta == {"step": 42}  # the latest version wins
    for got, want in zip(tensors, state(2), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def test_dead_donor_is_replaced_without_starting_over(
        swarm_factory: Callable[..., LocalSwarm]) -> None:
    """Donor 0 is dead before the download, donor 1 dies in the middle of a range (its daemon
    exits after sending 2 MiB of it): the joiner still gets the state whole, and donor 1's
    range resumes at the byte where it stopped, from another donor."""
    swarm = swarm_factory(4, env_by_index={1: {"MOSHPITD_FAULT": "die-mid-serve"}})
    clients = [moshpit.Client(s) for s in swarm.sockets]
    big = 24 << 20  # 96 MiB of float32: several ranges per donor
    published = state(7, big)
    for c in clients[:3]:  # three donors of one version (the same step)
        assert c.publish_state("big", published, {"step": 7}, version=7) == 7
    joiner = clients[3]
    swarm.daemons[0].kill()
    tensors, meta = joiner.download_state("big", timeout=30)
    assert meta == {"step": 7}
    for got, want in zip(tensors, published, strict=True):
        assert torch.equal(got, want)
    assert swarm.daemons[3].alive() and not swarm.daemons[1].alive()
    assert joiner.last_download is not None and joiner.last_download["served_by"] == 1
    log = swarm.daemons[3].log_path.read_text()
    resumed = [int(m) for m in re.findall(r"failed at byte (\d+)", log)]
    range_size = 4 << 20
    # donor 1 died 2 MiB into a range: that range resumed there, not at its start
    assert any(pos % range_size == 2 << 20 for pos in resumed), resumed


def test_download_is_spread_over_the_donors(swarm_factory: Callable[..., LocalSwarm]) -> None:
    swarm = swarm_factory(4)
    clients = [moshpit.Client(s) for s in swarm.sockets]
    published = state(3, 24 << 20)  # 96 MiB: 24 ranges for three donors
    for c in clients[:3]:
        c.publish_state("spread", published, {"step": 3}, version=3)
    tensors, _ = clients[3].download_state("spread", timeout=30)
    for got, want in zip(tensors, published, strict=True):
        assert torch.equal(got, want)
    assert clients[3].last_download == {"version": 3, "donors": 3, "served_by": 3}


def test_donors_publishing_again_do_not_break_a_download(
        swarm_factory: Callable[..., LocalSwarm]) -> None:
    """Trainers publish after every round. A joiner learns the latest version, then its
    donors publish a newer one before and while it downloads: it still gets the version it
    asked for, whole (the donors keep serving it), not an error and not a mix."""
    swarm = swarm_factory(3)
    donors = [moshpit.Client(s) for s in swarm.sockets[:2]]
    numel = 8 << 20

    def versioned(step: int) -> list[torch.Tensor]:
        return [torch.full((numel,), float(step)), torch.full((3, 4), -float(step),
                                                               dtype=torch.float64)]

    def publish(step: int) -> None:
        for c in donors:
            c.publish_state("churn", versioned(step), {"step": step}, version=step)

    late = threading.Timer(0.05, publish, (3,))

    class Joiner(moshpit.Client):
        def _request(self, msg: Message, timeout: float, **kw: Any) -> dict[str, Any]:
            if msg.OP == "download_state":
                publish(2)  # between learning the version and downloading it
                late.start()  # and (likely) during the download
            return super()._request(msg, timeout, **kw)

    publish(1)
    joiner = Joiner(swarm.sockets[2])
    tensors, meta = joiner.download_state("churn", timeout=30)
    assert meta == {"step": 1}
    assert torch.equal(tensors[0], torch.full((numel,), 1.0))
    assert torch.equal(tensors[1], torch.full((3, 4), -1.0, dtype=torch.float64))
    assert joiner.last_download is not None and joiner.last_download["version"] == 1
    assert joiner.last_download["served_by"] == 2
    late.join()  # the late publish is done: the next joiner gets the newest version
    _, meta = moshpit.Client(swarm.sockets[2]).download_state("churn", timeout=30)
    assert meta == {"step": 3}


def test_donors_with_other_bytes_under_one_version_are_not_spliced(
        swarm_factory: Callable[..., LocalSwarm]) -> None:
    """Two donors claim the same version with different bytes (diverged peers, or a liar):
    every range is checked against the digests of the donor whose header was taken, so the
    joiner gets one donor's state whole, never a mix of both."""
    swarm = swarm_factory(3)
    a, b, joiner = (moshpit.Client(s) for s in swarm.sockets)
    numel = 24 << 20  # 96 MiB: many ranges, so both donors would serve some
    a.publish_state("split", [torch.full((numel,), 1.0)], {"who": "a"}, version=5)
    b.publish_state("split", [torch.full((numel,), 2.0)], {"who": "b"}, version=5)
    tensors, meta = joiner.download_state("split", timeout=60)
    want = 1.0 if meta["who"] == "a" else 2.0
    assert torch.equal(tensors[0], torch.full((numel,), want))
    assert joiner.last_download is not None and joiner.last_download["served_by"] == 1
    assert "do not match the header's digest" in swarm.daemons[2].log_path.read_text()
