"""What a swarm-key holder can no longer do to joiners (attack 4) and what a trainer can no
longer do to its daemon through IPC (attack 7), on real daemons holding the swarm key. A test
passes when honest results are correct (the honest donor's state, the exact mean) or the
attacker gets a clear error; never merely when a call completed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import moshpit
from moshpitd.ipc.schema import MAX_BUFFERS
from moshpitd.launcher import DaemonProcess, LocalSwarm
from tests.integration.helpers import run_parallel, wait_until
from tests.integration.test_grid import check_round
from tests.integration.test_identity_attacks import swarm_key

RUN = "run/state"


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    tmp = tmp_path_factory.mktemp("joiner-ipc-attacks")
    _, args = swarm_key(tmp)
    s = LocalSwarm(3, workdir=tmp / "swarm", extra_args=args)
    try:
        yield s.start()
    finally:
        s.stop()


def trainer_state(value: float, n: int = 1000) -> list[torch.Tensor]:
    return [torch.full((n,), value), torch.full((3,), value, dtype=torch.float64)]


def test_a_joiner_is_not_captured_by_one_donor_far_ahead(swarm: LocalSwarm) -> None:
    """Attack 4: a trainer publishes 666/-666 at local step 10^9 as version 2^63-1, through
    the ordinary client API. Before, every joiner took it, even after honest donors published
    newer steps. Now a version that no other peer's signed donor record comes near is
    refused, and the joiner takes the honest state."""
    with contextlib.ExitStack() as stack:
        honest, other, attacker, joiner = (stack.enter_context(moshpit.Client(d.socket))
                                           for d in [*swarm.daemons, swarm.daemons[0]])
        joins_honestly(swarm, honest, other, attacker, joiner)


def joins_honestly(swarm: LocalSwarm, honest: moshpit.Client, other: moshpit.Client,
                   attacker: moshpit.Client, joiner: moshpit.Client) -> None:
    honest.publish_state(RUN, trainer_state(41.0), {"local_step": 41}, version=41)
    attacker.publish_state(RUN, [torch.full((1000,), 666.0), torch.full((3,), -666.0,
                           dtype=torch.float64)], {"local_step": 10**9}, version=2**63 - 1)
    other.publish_state(RUN, trainer_state(42.0), {"local_step": 42}, version=42)
    # the joiner, beside the first honest donor, sees the other two donors' records
    tensors, meta = joiner.download_state(RUN, timeout=20)
    assert meta == {"local_step": 42}
    for got, want in zip(tensors, trainer_state(42.0), strict=True):
        assert torch.equal(got, want)
    log = swarm.daemons[0].log_path.read_text()
    assert f"announces version {2**63 - 1}, beyond what any other peer's record shows" in log
    # the honest donor moves on: the joiner follows it, the attacker's version stays refused
    other.publish_state(RUN, trainer_state(43.0), {"local_step": 43}, version=43)
    tensors, meta = joiner.download_state(RUN, timeout=20)
    assert meta == {"local_step": 43} and torch.equal(tensors[0], trainer_state(43.0)[0])
    assert joiner.last_download is not None and joiner.last_download["version"] == 43


def memfd_maps(daemon: DaemonProcess) -> int:
    """Trainers' buffers the daemon has mapped (each a memfd the client names 'moshpit')."""
    with open(f"/proc/{daemon.proc.pid}/maps") as f:
        return sum(1 for line in f if "memfd:moshpit" in line)


def fds(daemon: DaemonProcess) -> int:
    return len(list(Path(f"/proc/{daemon.proc.pid}/fd").iterdir()))


def test_attaching_without_end_is_bounded(swarm: LocalSwarm) -> None:
    """Attack 7: a trainer attaches buffer 1 again and again. Before, every old mapping was
    kept until the session closed, and 20k of them exhausted the daemon; rounds then came
    back "ok" with local values only. Now a replaced buffer no request uses is unmapped at
    once (buffer ids were already bounded), and rounds stay exact."""
    d0 = swarm.daemons[0]
    before_maps, before_fds = memfd_maps(d0), fds(d0)
    with moshpit.Client(d0.socket) as attacker:
        for _ in range(300):
            attacker._attach(1, 4096)
        assert memfd_maps(d0) == before_maps + 1  # the latest mapping of buffer 1 only
        assert fds(d0) <= before_fds + 2
        for bid in range(MAX_BUFFERS):
            attacker._attach(bid, 4096)
            attacker._attach(bid, 4096)
        assert memfd_maps(d0) == before_maps + MAX_BUFFERS
        with pytest.raises(moshpit.InvalidRequest, match=f"0..{MAX_BUFFERS - 1}"):
            attacker._attach(MAX_BUFFERS, 4096)
        # trainers on other sessions of that daemon still average exactly
        ids = [d.info["peer_id"] for d in swarm.daemons]
        xs = {pid: torch.randn(5000, generator=torch.Generator().manual_seed(i))
              for i, pid in enumerate(ids)}

        def one(i: int) -> set[str]:
            with moshpit.Client(swarm.daemons[i].socket) as c:
                (out,) = c.average([xs[ids[i]]], key="after-attaches", timeout=20,
                                   group_size=3)
                assert c.last_round is not None and c.last_round.fully_averaged
                return check_round(out, c.last_round, ids[i], xs, dict.fromkeys(ids, 1.0))
        groups = run_parallel([lambda i=i: one(i) for i in range(3)])
        assert all(g == set(ids) for g in groups), groups
    # the sessions' mappings go once the daemon sees them close
    wait_until(lambda: memfd_maps(d0) == before_maps, 10, "the sessions' buffers unmapped")
    assert d0.alive() and "Traceback" not in d0.log_path.read_text()
