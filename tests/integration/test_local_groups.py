"""Local groups between real daemons: several trainer processes per daemon average as one peer
of the swarm. Two daemons stand for two hosts; the trainers are real processes, so one can be
SIGKILLed while it waits for the others."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

import moshpit
from moshpit import device_copy
from moshpitd.launcher import LocalSwarm
from tests.integration.helpers import run_parallel, wait_until, weighted_mean
from tests.integration.local_trainers import Trainer, context, diloco_trainer, wait_ranks

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


def test_shards_are_one_vector_split_by_rank(hosts: LocalSwarm) -> None:
    """2 hosts x 2 shard ranks, each host splitting the same three tensors otherwise: the
    schema is the concatenation's, every rank gets its slice of the weighted mean of the two
    hosts' vectors (each weighing the sum of its ranks' weights), and spans per rank."""
    a, b = tensors(30), tensors(31)
    split = {0: [[0, 1], [2]], 1: [[0], [1, 2]]}  # host -> rank -> tensor indices
    weights = {0: [1.0, 2.0], 1: [4.0, 5.0]}
    hosts_values = {0: a, 1: b}
    trainers = {(h, r): Trainer(hosts.sockets[h], [hosts_values[h][k] for k in split[h][r]],
                                key="shards", weight=weights[h][r], local_world=2,
                                local_rank=r, timeout=30)
                for h in (0, 1) for r in (0, 1)}
    mean = [weighted_mean([a[k], b[k]], [3.0, 9.0]) for k in range(len(SHAPES))]
    for (h, r), t in trainers.items():
        got, info = t.averaged()
        assert len(got) == len(split[h][r])
        for g, k in zip(got, split[h][r], strict=True):
            scale = max(np.abs(a[k]).max(), np.abs(b[k]).max())
            rtol = {np.float16: 2e-3, np.float32: 1e-6, np.float64: 1e-12}[SHAPES[k][1]]
            assert g.dtype == SHAPES[k][1]
            np.testing.assert_allclose(g.astype(np.float64), mean[k], rtol=0, atol=rtol * scale)
        size = sum(a[k].size for k in split[h][r])
        assert info["spans"] == ((0, size, 3),), info  # its own slice, from both hosts
        assert info["local_rank"] == r and info["local_ranks"] == (0, 1)
        assert info["group_size"] == 2


def test_a_missing_shard_rank_fails_every_rank(hosts: LocalSwarm) -> None:
    """A shard rank SIGKILLed while it waits fails the others at once, one that never comes
    fails them at the local deadline: LocalRankMissing names it, and nothing was sent."""
    x = tensors(40)
    with moshpit.Client(hosts.sockets[0]) as watch:
        victim = Trainer(hosts.sockets[0], x[:1], key="shard-dies", local_world=3,
                         local_rank=2, timeout=30)
        wait_ranks(watch, "shard-dies", [2])
        first = Trainer(hosts.sockets[0], x[1:], key="shard-dies", local_world=3,
                        local_rank=0, timeout=30)
        wait_ranks(watch, "shard-dies", [0, 2])
        victim.kill()
        name, message, rank = first.failed()
        assert name == "LocalRankMissing" and rank == 2 and "went away" in message
        # rank 1 never comes: the others fail at the deadline (half of their 3 s)
        waiting = [Trainer(hosts.sockets[0], x[:1], key="shard-absent", local_world=3,
                           local_rank=r, timeout=3) for r in (0, 2)]
        for t in waiting:
            name, message, rank = t.failed()
            assert name == "LocalRankMissing" and rank == 1, message
            assert "local rank(s) [1] of 3" in message and "nothing was sent" in message
        keys = {r["key"] for r in watch.rounds()}
        assert not keys & {"shard-dies", "shard-absent"}  # no round began: nothing half-made
        assert watch.status()["status"]["local_groups"] == {}


def test_disagreeing_shard_ranks_fail_the_host_naming_the_rank(hosts: LocalSwarm) -> None:
    """A rank with another local_world, or a replica among shards: every rank of the host
    gets LocalMismatch naming the rank that differs."""
    x = tensors(50)
    with moshpit.Client(hosts.sockets[0]) as watch:
        for key, odd in (("shard-world", dict(local_world=3, local_rank=1)),
                         ("shard-mode", dict(local_world=2))):
            first = Trainer(hosts.sockets[0], x, key=key, local_world=2, local_rank=0,
                            timeout=30)
            wait_ranks(watch, key, [0])
            other = Trainer(hosts.sockets[0], x, key=key, timeout=30, **odd)
            for t in (first, other):
                name, message, rank = t.failed()
                assert name == "LocalMismatch" and rank == 1, message
            assert ("says local_world=3, the first said 2" if key == "shard-world"
                    else "is in the other mode: the group holds shards") in message


def test_a_shard_shape_differing_across_hosts_names_the_rank(hosts: LocalSwarm) -> None:
    """2 hosts x 2 shard ranks; host B's rank 1 holds its first tensor with another shape.
    The hosts' vectors differ, and each host's ranks get SchemaMismatch naming rank 1 (the
    first whose tensors differ from that rank's at the other host); nothing was sent."""
    x = tensors(45)
    odd = [x[1][:-1], x[2]]
    split = {0: [x[:1], x[1:]], 1: [x[:1], odd]}
    trainers = [Trainer(hosts.sockets[h], split[h][r], key="shard-shapes", local_world=2,
                        local_rank=r, timeout=2 * ATTEMPT + 2) for h in (0, 1) for r in (0, 1)]
    for t in trainers:
        name, message, rank = t.failed()
        assert name == "SchemaMismatch" and rank == 1, message
        assert "local rank 1 of this host holds other tensors than local rank 1 of peer" in message
    for socket in hosts.sockets:  # one round per host, which found no group: nothing sent
        with moshpit.Client(socket) as c:
            rounds = [r for r in c.rounds() if r["key"] == "shard-shapes"]
        assert [(r["result"], r["bytes_sent"]) for r in rounds] == [("matchmaking_failed", 0)]


@pytest.mark.parametrize("mode", ["replicas", "shards"])
def test_diloco_optimizer_takes_local_world(hosts: LocalSwarm, mode: str) -> None:
    """moshpit.Optimizer passes local_world (and local_rank) through: DiLoCo with 2 hosts x 2
    local trainers takes the outer step on the weighted mean of the hosts' pseudo-gradients.
    Replicas each hold every tensor; shards hold tensor 0 (rank 0) and the rest (rank 1)."""
    rng = np.random.default_rng(60)
    init = [rng.standard_normal(shape).astype(np.float32) for shape, _ in SHAPES]
    steps, batches = 2, [1, 2, 3, 4]  # trainer i = host i // 2, local trainer i % 2
    held = [[0, 1, 2]] * 4 if mode == "replicas" else [[0], [1, 2]] * 2
    grads = [[[rng.standard_normal(init[k].shape).astype(np.float32) for k in held[i]]
              for _ in range(steps)] for i in range(4)]
    trainers = [diloco_trainer(hosts.sockets[i // 2], [init[k] for k in held[i]], grads[i],
                               batches[i], key=f"diloco-{mode}", local_world=2,
                               **({"local_rank": i % 2} if mode == "shards" else {}))
                for i in range(4)]
    # each trainer's pseudo-gradient is 0.1 x the sum of its gradients, weighted by its
    # samples; for shards a host's vector weighs the sum of its ranks' samples
    weight = [steps * b for b in batches]
    if mode == "shards":
        weight = [weight[0] + weight[1]] * 2 + [weight[2] + weight[3]] * 2
    pseudo: dict[int, list[tuple[np.ndarray, float]]] = {k: [] for k in range(len(init))}
    for i in range(4):
        for j, k in enumerate(held[i]):
            pseudo[k].append((0.1 * sum(g[j] for g in grads[i]), weight[i]))
    want = [init[k] - weighted_mean([p for p, _ in pseudo[k]], [w for _, w in pseudo[k]])
            for k in range(len(init))]
    for i, t in enumerate(trainers):
        rounds, error, global_params, info = t.result()
        assert rounds == 1, error
        assert info["group_size"] == 2 and info["local_ranks"] == (0, 1), info
        for g, k in zip(global_params, held[i], strict=True):
            np.testing.assert_allclose(g, want[k], rtol=1e-5, atol=1e-5)


# --- device tensors: averaged through the shared buffer (host memory) ---------------------
def test_share_refuses_device_tensors(hosts: LocalSwarm) -> None:
    with moshpit.Client(hosts.sockets[0]) as c, pytest.raises(TypeError, match="tensor 1 is on"):
        c.share([torch.zeros(3), torch.empty(3, device="meta")])


NO_CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="torch.cuda.is_available() is false: no CUDA device "
    "here, so the CUDA path (device tensors copied through the page-locked shared buffer on a "
    "side stream, or a pinned staging buffer) is unverified on this machine")


def cuda_round(hosts: LocalSwarm, key: str, first: Callable[[moshpit.Client, list[torch.Tensor]],
               list[torch.Tensor]] | None = None
               ) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """3 trainers with CUDA tensors: two replicas on host A, one on host B. `first` makes the
    first trainer's tensors from its inputs (share() them, say)."""
    inputs = [tensors(70 + i) for i in range(3)]
    clients = [moshpit.Client(hosts.sockets[i // 2]) for i in range(3)]
    given = [[torch.from_numpy(a).cuda() for a in x] for x in inputs]
    if first is not None:
        given[0] = first(clients[0], given[0])

    def call(i: int) -> list[torch.Tensor]:
        local = {"local_world": 2} if i < 2 else {}
        return clients[i].average(given[i], key=key, timeout=30, **local)

    try:
        results = run_parallel([lambda i=i: call(i) for i in range(3)])
    finally:
        for c in clients:
            c.close()
    for out in results:
        assert not isinstance(out, Exception), out
        assert all(t.device.type == "cuda" for t in out)
        assert_mean([t.cpu().numpy() for t in out], inputs, [1.0, 1.0, 1.0])
    return given, results


@NO_CUDA
def test_cuda_tensors_average_through_a_local_group(hosts: LocalSwarm) -> None:
    given, results = cuda_round(hosts, "cuda")
    for x, out in zip(given, results, strict=True):  # new tensors; the inputs untouched
        assert all(a.data_ptr() != b.data_ptr() for a, b in zip(x, out, strict=True))


@NO_CUDA
def test_cuda_tensors_from_share_are_averaged_in_place(hosts: LocalSwarm) -> None:
    given, results = cuda_round(hosts, "cuda-share", lambda c, x: c.share(x))
    assert all(a is b for a, b in zip(given[0], results[0], strict=True))


@NO_CUDA
def test_cuda_falls_back_to_staging_when_registering_fails(
        hosts: LocalSwarm, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(device_copy, "register", lambda addr, size: 712)
    monkeypatch.setattr(device_copy, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="moshpit"):
        cuda_round(hosts, "cuda-staged")
    assert sum("pinned staging buffer" in r.message for r in caplog.records) == 1


@NO_CUDA
def test_optimizer_averages_cuda_parameters(hosts: LocalSwarm) -> None:
    """moshpit.Optimizer on CUDA parameters, one trainer per host, lr 0: after one round both
    hold the weighted mean, still on the device (their wire buffers are on it too)."""
    inputs = [tensors(80 + i)[0] for i in range(2)]
    params = [torch.nn.Parameter(torch.from_numpy(x).cuda()) for x in inputs]
    opts = [moshpit.Optimizer(torch.optim.SGD([p], lr=0.0), client=hosts.sockets[i],
                              key="cuda-optimizer", average_every=1, timeout=30)
            for i, p in enumerate(params)]
    for p in params:
        p.grad = torch.zeros_like(p)
    results = run_parallel([lambda i=i: opts[i].step(batch_size=i + 1) for i in range(2)])
    assert not any(isinstance(r, Exception) for r in results), results
    for opt, p in zip(opts, params, strict=True):
        assert opt.rounds_done == 1, opt.last_error
        assert p.device.type == "cuda" and all(w.device.type == "cuda"
                                               for w in opt._wire[""])
        np.testing.assert_allclose(p.detach().cpu().numpy(), weighted_mean(inputs, [1, 2]),
                                   rtol=0, atol=1e-5 * float(np.abs(inputs).max()))
        opt.close()
