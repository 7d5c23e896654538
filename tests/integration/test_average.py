"""End to end: real daemons, real clients, one averaging round crossing every layer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import moshpit
from moshpitd.launcher import LocalSwarm
from tests.integration.helpers import assert_close_to_mean, run_parallel

BIN = Path(sys.executable).parent  # the console scripts installed next to this interpreter

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


@pytest.mark.parametrize("bad", [
    [torch.zeros(1000), torch.zeros(7, 14)],  # the second shape differs
    [torch.zeros(1000), torch.zeros(7, 13, dtype=torch.float64)],  # the same shapes, a dtype not
], ids=["shape", "dtype"])
def test_mismatched_schema_gets_clear_error_others_succeed(swarm4: LocalSwarm,
                                                           bad: list[torch.Tensor]) -> None:
    good = [make_tensors(i)[:2] for i in range(3)]
    assert [t.shape for t in good[0]] == [torch.Size([1000]), torch.Size([7, 13])]
    assert [t.dtype for t in good[0]] == [torch.float32, torch.float32]
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
    assert "dtypes" in str(results[3]) and "shapes" in str(results[3])


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
    human = subprocess.run(  # the installed console script, not just the module
        [str(BIN / "moshpit"), "status", "--socket", swarm4.sockets[0]],
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


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_cleanly(swarm_factory: Callable[..., LocalSwarm],
                              sig: signal.Signals) -> None:
    swarm = swarm_factory(2)
    sockets = [d.socket for d in swarm.daemons]
    assert all(os.path.exists(s) for s in sockets)
    for d in swarm.daemons:
        d.proc.send_signal(sig)
    codes = [d.proc.wait(timeout=20) for d in swarm.daemons]
    assert codes == [0, 0], [d.log_tail() for d in swarm.daemons]
    assert not any(os.path.exists(s) for s in sockets)
    for d in swarm.daemons:
        log = d.log_path.read_text()
        assert f"{sig.name}: draining" in log, log
        assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
        assert not Path(d.info["ready_file"]).exists()


def test_daemon_runs_on_uvloop(swarm_factory: Callable[..., LocalSwarm]) -> None:
    (daemon,) = swarm_factory(1).daemons
    assert "event loop: uvloop.Loop" in daemon.log_path.read_text(), daemon.log_tail()


VICTIM = textwrap.dedent("""
    import sys, torch, moshpit
    c = moshpit.Client(sys.argv[1])
    print("connected", flush=True)
    c.average([torch.full((int(sys.argv[2]),), 1.0)], key="reused", timeout=20, group_size=2)
    print("done", flush=True)
""")


def test_trainer_killed_mid_round_then_key_reused(swarm_factory: Callable[..., LocalSwarm],
                                                  tmp_path: Path) -> None:
    """The victim's daemon pauses 1.5 s after the first part it streams (the slow-send fault)
    and writes a marker as it does: the trainer is SIGKILLed then, with the group formed and
    the all-reduce running. Its daemon finishes the round and forgets the request, so both
    daemons average again under the same key."""
    marker = tmp_path / "sending"
    swarm = swarm_factory(2, env_by_index={0: {"MOSHPITD_FAULT": "slow-send@1",
                                               "MOSHPITD_FAULT_MARKER": str(marker)}})
    elems = 2 << 20  # 8 MiB: several 1 MiB parts per span, so there is a second part to pause at
    victim = subprocess.Popen([sys.executable, "-c", VICTIM, swarm.sockets[0], str(elems)],
                              stdout=subprocess.PIPE, text=True)
    assert victim.stdout is not None and victim.stdout.readline().strip() == "connected"
    partner = moshpit.Client(swarm.sockets[1])
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(partner.average, [torch.full((elems,), 3.0)], key="reused",
                            timeout=20, group_size=2)
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline and victim.poll() is None:
            time.sleep(0.005)
        assert marker.exists(), f"the round never started:\n{swarm.daemons[0].log_tail()}"
        victim.kill()
        rest, _ = victim.communicate(timeout=10)
        assert "done" not in rest  # killed before its round returned: mid-round
        try:
            out = first.result(timeout=40)  # the partner's round ends one way or the other
        except moshpit.MoshpitError:
            out = None  # the victim's side may fail the round: an error is allowed, a hang not
    if out is not None:  # each span is the mean if the victim's part arrived, else 3.0 (own)
        info = partner.last_round
        assert info is not None and info.group_size == 2, info
        assert sum(stop - start for start, stop, _ in info.spans) == elems
        for start, stop, mask in info.spans:
            want = 2.0 if mask == 0b11 else 3.0
            assert torch.equal(out[0][start:stop], torch.full((stop - start,), want)), mask
    assert swarm.daemons[0].alive() and swarm.daemons[1].alive()
    # the victim's daemon ran the round with the group (the kill landed after it assembled)
    survivor = moshpit.Client(swarm.sockets[0])
    rounds = [r for r in survivor.rounds() if r["key"] == "reused"]
    assert len(rounds) == 1 and rounds[0]["group_size"] == 2, rounds
    # the same key again: not refused as a duplicate of the dead trainer's request
    results = run_parallel([
        lambda: survivor.average([torch.full((1000,), 5.0)], key="reused", timeout=20,
                                 group_size=2),
        lambda: partner.average([torch.full((1000,), 1.0)], key="reused", timeout=20,
                                group_size=2)])
    for r in results:
        assert not isinstance(r, Exception), r
        assert torch.equal(r[0], torch.full((1000,), 3.0))
    assert survivor.last_round is not None and survivor.last_round.fully_averaged
    survivor.close()
    partner.close()
