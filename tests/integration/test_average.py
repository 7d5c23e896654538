"""End to end: real daemons, real clients, one averaging round crossing every layer."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest
import torch

import moshpit
from moshpitd.launcher import LocalSwarm
from tests.integration.helpers import assert_close_to_mean, run_parallel

SHAPES = [((1000,), torch.float32), ((7, 13), torch.float32), ((333,), torch.float64),
          ((65,), torch.float16), ((600_000,), torch.float32), ((3, 2, 5), torch.float64)]


def make_tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64).mul(10).to(dtype)
            for shape, dtype in SHAPES]


def test_four_daemons_weighted_mean(swarm4: LocalSwarm) -> None:
    weights = [0.5, 1.0, 2.0, 3.5]
    inputs = [make_tensors(i) for i in range(4)]
    clients = [moshpit.Client(s) for s in swarm4.sockets]

    def call(i: int) -> list[torch.Tensor]:
        return clients[i].average(inputs[i], key="run1", weight=weights[i], timeout=30,
                                  group_size=4)

    for repeat in range(2):  # the same key twice: stale declarations must not get in the way
        results = run_parallel([lambda i=i: call(i) for i in range(4)])
        for r in results:
            assert not isinstance(r, Exception), r
        for i, result in enumerate(results):
            assert clients[i].last_round is not None
            assert clients[i].last_round.group_size == 4, (repeat, clients[i].last_round)
            for k in range(len(SHAPES)):
                assert_close_to_mean(result[k], [inp[k] for inp in inputs], weights)
    # inputs are untouched: the client copies into the shared buffer
    assert torch.equal(inputs[0][0], make_tensors(0)[0])
    for c in clients:
        c.close()


def test_mismatched_schema_gets_clear_error_others_succeed(swarm4: LocalSwarm) -> None:
    good = [make_tensors(i)[:2] for i in range(3)]
    bad = [torch.zeros(1000), torch.zeros(7, 14)]  # second shape differs
    clients = [moshpit.Client(s) for s in swarm4.sockets]

    def call_good(i: int) -> list[torch.Tensor]:
        return clients[i].average(good[i], key="mixed", timeout=20, group_size=4)

    def call_bad() -> list[torch.Tensor]:
        return clients[3].average(bad, key="mixed", timeout=6, group_size=4)

    results = run_parallel([lambda i=i: call_good(i) for i in range(3)] + [call_bad])
    for i in range(3):
        assert not isinstance(results[i], Exception), results[i]
        for k in range(2):
            assert_close_to_mean(results[i][k], [g[k] for g in good], [1.0, 1.0, 1.0])
    assert isinstance(results[3], moshpit.SchemaMismatch), results[3]
    assert "shapes" in str(results[3])


def test_status_cli_and_metrics(swarm4: LocalSwarm) -> None:
    clients = [moshpit.Client(s) for s in swarm4.sockets[:2]]
    results = run_parallel([lambda c=c: c.average([torch.ones(10)], key="m", timeout=20)
                            for c in clients])
    assert all(not isinstance(r, Exception) for r in results), results
    out = subprocess.run(
        [sys.executable, "-m", "moshpit.cli", "status", "--socket", swarm4.sockets[0], "--json"],
        capture_output=True, text=True, timeout=30, check=True,
    )
    status = json.loads(out.stdout)
    d0 = swarm4.daemons[0].info
    assert status["peer_id"] == d0["peer_id"]
    assert status["dht"] == d0["dht"] and status["grpc"] == d0["grpc"]
    assert status["dht_peers"] >= 3
    assert status["rounds_done"] == 1
    human = subprocess.run(
        [sys.executable, "-m", "moshpit.cli", "status", "--socket", swarm4.sockets[0]],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout
    assert d0["peer_id"] in human and "rounds done  1" in human
    body = urllib.request.urlopen(f"http://{d0['metrics']}/metrics", timeout=10).read().decode()
    assert 'moshpitd_rounds_total{result="ok"} 1.0' in body
    assert "moshpitd_round_duration_seconds_count 1.0" in body


def test_cli_reports_unreachable_daemon(tmp_path: pytest.TempPathFactory) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "moshpit.cli", "status", "--socket", f"{tmp_path}/nope.sock"],
        capture_output=True, text=True, timeout=30,
    )
    assert out.returncode == 1 and "cannot connect" in out.stderr


def test_sigterm_stops_cleanly(swarm_factory: object) -> None:
    swarm = swarm_factory(2)  # type: ignore[operator]
    sockets = [d.socket for d in swarm.daemons]
    codes = swarm.stop()
    assert codes == [0, 0]
    import os
    assert not any(os.path.exists(s) for s in sockets)
