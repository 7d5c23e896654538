"""Local groups between real daemons: several trainer processes per daemon average as one peer
of the swarm. Two daemons stand for two hosts; the trainers are real processes, so one can be
SIGKILLed while it waits for the others."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import moshpit
from moshpitd.launcher import LocalSwarm
from tests.integration.helpers import wait_until, weighted_mean
from tests.integration.local_trainers import Trainer, context, wait_ranks

# the local deadline is one matchmaking attempt (RoundClock.local_deadline): long enough for
# the kill test to line its trainers up, short enough to wait for
ATTEMPT = 4.0
SHAPES = [((1000,), np.float32), ((65,), np.float16), ((7, 3), np.float64)]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    context()  # the trainers' fork server imports torch meanwhile
    swarm = LocalSwarm(2, workdir=tmp_path_factory.mktemp("local"),
                       extra_args=["--matchmaking-attempt-timeout", str(ATTEMPT)])
    swarm.start()
    yield swarm
    assert all(d.alive() for d in swarm.daemons)
    swarm.stop()
    for d in swarm.daemons:  # no daemon met what it did not expect
        log = d.log_path.read_text()
        assert "Traceback" not in log and "never retrieved" not in log, d.log_tail(60)


def tensors(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(shape) * 10).astype(dtype) for shape, dtype in SHAPES]


def assert_mean(got: list[np.ndarray], inputs: list[list[np.ndarray]],
                weights: list[float]) -> None:
    """Each tensor within its dtype's precision of the weighted mean of the inputs."""
    for k, (_, dtype) in enumerate(SHAPES):
        want = weighted_mean([x[k] for x in inputs], weights)
        rtol = {np.float16: 2e-3, np.float32: 1e-6, np.float64: 1e-12}[dtype]
        scale = np.abs(np.stack([x[k] for x in inputs]).astype(np.float64)).max()
        assert got[k].dtype == dtype and got[k].shape == want.shape
        np.testing.assert_allclose(got[k].astype(np.float64), want, rtol=0, atol=rtol * scale)


def test_replicas_weighted_mean_of_two_hosts(hosts: LocalSwarm) -> None:
    """2 hosts x 2 replicas: every trainer gets the weighted mean of all four, and each host
    took part as one peer (a group of 2) weighing the sum of its replicas' weights."""
    weights = [1.0, 2.0, 3.0, 4.5]
    inputs = [tensors(i) for i in range(4)]
    trainers = [Trainer(hosts.sockets[i // 2], inputs[i], key="replicas", weight=weights[i],
                        local_world=2, timeout=30) for i in range(4)]
    infos = []
    for t in trainers:
        got, info = t.averaged()
        assert_mean(got, inputs, weights)
        assert info["group_size"] == 2 and info["local_ranks"] == (0, 1), info
        infos.append(info)
    for host in (infos[:2], infos[2:]):
        assert sorted(i["local_rank"] for i in host) == [0, 1]
        # one vector per host: both trainers report the host's single all-reduce
        assert host[0]["bytes_sent"] == host[1]["bytes_sent"] > 0
    with moshpit.Client(hosts.sockets[0]) as c:  # one round per host, not one per trainer
        rounds = [r for r in c.rounds() if r["key"] == "replicas"]
    assert [r["group_size"] for r in rounds] == [2]


def test_killed_replica_is_left_out(hosts: LocalSwarm) -> None:
    """Host A expects 3 replicas; the second is SIGKILLed while it waits. At the local deadline
    the other two average with host B's trainer as one peer, and RoundInfo names them."""
    inputs = [tensors(10 + i) for i in range(4)]
    weights = [1.0, 5.0, 2.0, 3.0]
    key, world = "left-out", 3
    with moshpit.Client(hosts.sockets[0]) as watch:
        first = Trainer(hosts.sockets[0], inputs[0], key=key, weight=weights[0],
                        local_world=world, timeout=30)
        wait_ranks(watch, key, [0])
        victim = Trainer(hosts.sockets[0], inputs[1], key=key, weight=weights[1],
                         local_world=world, timeout=30)
        wait_ranks(watch, key, [0, 1])
        victim.kill()
        wait_ranks(watch, key, [0])
        third = Trainer(hosts.sockets[0], inputs[2], key=key, weight=weights[2],
                        local_world=world, timeout=30)
        other = Trainer(hosts.sockets[1], inputs[3], key=key, weight=weights[3], timeout=30)
        alive = [0, 2, 3]
        for rank, t in ((0, first), (2, third)):
            got, info = t.averaged()
            assert_mean(got, [inputs[i] for i in alive], [weights[i] for i in alive])
            assert info["local_rank"] == rank and info["local_ranks"] == (0, 2), info
            assert info["group_size"] == 2
        got, info = other.averaged()
        assert_mean(got, [inputs[i] for i in alive], [weights[i] for i in alive])
        assert info["local_ranks"] == () and info["local_rank"] is None
        assert watch.status()["status"]["local_groups"] == {}  # nothing left behind


def test_disagreeing_and_late_replicas_are_told(hosts: LocalSwarm) -> None:
    """Replicas that disagree with the first (local_world, shapes) are refused naming their
    rank while the first waits; at the deadline it leaves for the swarm round alone, a
    trainer coming then is told it is late, and the round goes on with host B."""
    key = "disagree"
    with moshpit.Client(hosts.sockets[0]) as watch:
        first = Trainer(hosts.sockets[0], tensors(20), key=key, local_world=2, timeout=30)
        wait_ranks(watch, key, [0])
        second = Trainer(hosts.sockets[0], tensors(21), key=key, local_world=3, timeout=30)
        name, message, rank = second.failed()
        assert name == "LocalMismatch" and rank == 1
        assert "local rank 1 says local_world=3, the first said 2" in message
        shape = Trainer(hosts.sockets[0], [x[:3] for x in tensors(22)], key=key,
                        local_world=2, timeout=30)
        name, message, rank = shape.failed()
        assert name == "LocalMismatch" and rank == 1
        assert "sent tensor 0 as float32 [3], the first as float32 [1000]" in message
        wait_until(lambda: watch.status()["status"]["local_groups"].get(key, {}).get("state")
                   == "averaging", ATTEMPT + 5, "the group leaving at its local deadline")
        name, message, _ = Trainer(hosts.sockets[0], tensors(23), key=key, local_world=2,
                                   timeout=30).failed()
        assert name == "LocalLate" and "left for its swarm round without this trainer" in message
        plain = Trainer(hosts.sockets[1], tensors(24), key=key, timeout=30)
        got, info = first.averaged()
        assert_mean(got, [tensors(20), tensors(24)], [1.0, 1.0])
        assert info["local_ranks"] == (0,)
        plain.averaged()
