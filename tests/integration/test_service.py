"""Running moshpitd as a service: settings from a file, the gRPC health service, JSON logs,
the inspection CLI, and a graceful drain on SIGTERM that peers and trainers can see."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

import moshpit
from moshpitd.launcher import LocalSwarm, start_daemon, wait_ready
from tests.integration.helpers import run_parallel


def average_once(socket: str, value: float, key: str = "svc", timeout: float = 15.0,
                 group_size: int = 2) -> moshpit.RoundInfo:
    with moshpit.Client(socket) as c:
        (out,) = c.average([torch.full((1000,), value)], key=key, group_size=group_size,
                           min_group_size=2, timeout=timeout)
        assert torch.equal(out, torch.full((1000,), out[0].item()))
        assert c.last_round is not None
        return c.last_round


def test_settings_come_from_file_env_and_flags_in_that_order(tmp_path: Path) -> None:
    ready = tmp_path / "from-file.json"
    conf = tmp_path / "moshpitd.toml"
    conf.write_text(f'ipc_socket = "{tmp_path}/file.sock"\nready_file = "{ready}"\n'
                    f'dht_listen = "127.0.0.1:0"\ngrpc_listen = "127.0.0.1:0"\n'
                    f'metrics_listen = "127.0.0.1:0"\nlog_level = "DEBUG"\n'
                    f'peer_key_file = "{tmp_path}/peer.key"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOSHPITD_")}
    env["MOSHPITD_IPC_SOCKET"] = str(tmp_path / "env.sock")  # env beats the file
    proc = subprocess.Popen([sys.executable, "-m", "moshpitd", "--config", str(conf),
                             "--log-level", "WARNING"],  # the flag beats the file
                            env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not ready.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        assert info["ipc"] == str(tmp_path / "env.sock")
        assert Path(info["ipc"]).exists() and not (tmp_path / "file.sock").exists()
        with moshpit.Client(info["ipc"]) as c:
            assert c.status()["status"]["peer_id"] == info["peer_id"]
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0
    assert " INFO " not in err and " DEBUG " not in err  # WARNING from the flag
    assert not ready.exists()  # removed on a clean stop


def test_health_service_reports_serving_then_not_serving_on_drain(tmp_path: Path) -> None:
    d = start_daemon("h", tmp_path, extra_args=["--drain-timeout", "3"])
    try:
        with grpc.insecure_channel(d.info["grpc"]) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", "moshpit.Averager"):
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
            with pytest.raises(grpc.RpcError) as info:
                stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=15)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            d.proc.send_signal(signal.SIGTERM)
            seen = [r.status for r in _until_closed(watch)]
            assert health_pb2.HealthCheckResponse.NOT_SERVING in seen, seen
        assert d.proc.wait(15) == 0
    finally:
        d.kill()


def _until_closed(watch: Any) -> list[Any]:
    out = []
    try:
        for item in watch:
            out.append(item)
    except grpc.RpcError:
        pass
    return out


def test_json_logs_carry_one_line_per_round_and_cli_shows_it(tmp_path: Path) -> None:
    with LocalSwarm(2, workdir=tmp_path, extra_args=["--log-format", "json"]) as swarm:
        results = run_parallel([lambda s=s, v=v: average_once(s, v)  # type: ignore[misc]
                                for s, v in zip(swarm.sockets, (1.0, 3.0), strict=True)])
        assert all(isinstance(r, moshpit.RoundInfo) for r in results), results
        cli = [sys.executable, "-m", "moshpit.cli"]
        out = subprocess.run([*cli, "rounds", "--json", "--socket", swarm.sockets[0]],
                             capture_output=True, text=True, timeout=30, check=True)
        rounds = json.loads(out.stdout)
        assert [r["result"] for r in rounds] == ["ok"] and rounds[0]["group_size"] == 2
        out = subprocess.run([*cli, "peers", "--json", "--socket", swarm.sockets[0]],
                             capture_output=True, text=True, timeout=30, check=True)
        peers = json.loads(out.stdout)
        other = swarm.daemons[1].info
        assert [c["peer_id"] for c in peers["contacts"]] == [other["peer_id"]]
        assert peers["contacts"][0]["dht"].endswith(other["dht"].rsplit(":", 1)[1])
        out = subprocess.run([*cli, "peers", "--socket", swarm.sockets[0]],
                             capture_output=True, text=True, timeout=30, check=True)
        assert "1 DHT contact(s)" in out.stdout and other["peer_id"][:16] in out.stdout
        out = subprocess.run([*cli, "status", "--json", "--socket", swarm.sockets[0]],
                             capture_output=True, text=True, timeout=30, check=True)
        assert json.loads(out.stdout)["rounds_done"] == 1
        log_path = swarm.daemons[0].log_path
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    round_lines = [x for x in lines if x.get("result") is not None]
    assert len(round_lines) == 1, round_lines
    r = round_lines[0]
    assert r["level"] == "INFO" and r["key"] == "svc" and r["group_size"] == 2
    assert r["bytes_sent"] > 0 and r["bytes_received"] > 0 and r["seconds"] > 0
    assert r["result"] == "ok"


def test_sigterm_drains_cleanly_while_peers_keep_averaging(tmp_path: Path) -> None:
    """Three trainers average in a loop; one daemon gets SIGTERM. It exits 0 within its drain
    timeout, its trainer gets DaemonShuttingDown (not a hang), and the other two go on in
    groups of two without waiting out a timeout or excluding anyone for silence."""
    timeout = 10.0
    with LocalSwarm(3, workdir=tmp_path, extra_args=["--drain-timeout", "4"]) as swarm:
        stop = threading.Event()
        history: list[list[tuple[float, Any]]] = [[], [], []]

        def trainer(rank: int) -> None:
            with moshpit.Client(swarm.sockets[rank]) as c:
                t = torch.zeros(200_000)
                while not stop.is_set():
                    t.fill_(float(rank))
                    began = time.monotonic()
                    try:
                        c.average([t], key="drain", group_size=3, min_group_size=2,
                                  timeout=timeout)
                        info: Any = c.last_round
                    except moshpit.MoshpitError as exc:
                        info = exc
                    history[rank].append((time.monotonic() - began, info))
                    if isinstance(info, moshpit.DaemonUnavailable):
                        return

        threads = [threading.Thread(target=trainer, args=(r,), daemon=True) for r in range(3)]
        for th in threads:
            th.start()
        deadline = time.monotonic() + 60
        while min(len(h) for h in history) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert min(len(h) for h in history) >= 3, history
        before = [len(h) for h in history]
        victim = swarm.daemons[2]
        term = time.monotonic()
        victim.proc.send_signal(signal.SIGTERM)
        code = victim.proc.wait(15)
        exited = time.monotonic() - term
        # it said goodbye on the DHT: its peers dropped it at once, not after RPC timeouts
        for sock in swarm.sockets[:2]:
            with moshpit.Client(sock) as c:
                assert c.status()["status"]["dht_peers"] == 1
        threads[2].join(10)
        # the survivors keep going for a while after the departure
        while min(len(history[r]) for r in (0, 1)) < before[0] + 6 and \
                time.monotonic() < deadline + 30:
            time.sleep(0.05)
        stop.set()
        for th in threads[:2]:
            th.join(timeout + 5)
    assert code == 0, victim.log_tail()
    assert exited < 4 + 3, exited
    last = history[2][-1][1]
    assert isinstance(last, moshpit.DaemonShuttingDown), history[2][-3:]
    assert "shutting down" in str(last)
    after = [history[r][before[r] + 2:] for r in (0, 1)]  # skip the rounds around the SIGTERM
    for rank, rounds in enumerate(after):
        assert len(rounds) >= 3, history[rank]
        for seconds, info in rounds:
            assert isinstance(info, moshpit.RoundInfo) and info.group_size == 2, info
            assert seconds < timeout / 2, (seconds, info)
    log = victim.log_path.read_text()
    assert "draining" in log and "drained in" in log
    for d in swarm.daemons[:2]:
        assert "silent past the round's deadline" not in d.log_path.read_text()


def test_sigterm_with_an_idle_trainer_attached(tmp_path: Path) -> None:
    d = start_daemon("idle", tmp_path)
    wait_ready(d)
    client = moshpit.Client(d.socket)
    try:
        client.status()
        began = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(10) == 0
        assert time.monotonic() - began < 3
        assert not Path(d.socket).exists()
        with pytest.raises(moshpit.DaemonShuttingDown, match="shutting down"):
            client.status()
    finally:
        client.close()
        d.kill()


def test_sigterm_mid_allreduce_finishes_the_round_first(tmp_path: Path) -> None:
    """SIGTERM arrives while a round is averaging (its partner is slow mid-send): the daemon
    waits for the round, both trainers get the exact mean, and only then does it leave."""
    marker = tmp_path / "slow"
    with LocalSwarm(2, workdir=tmp_path, extra_args=["--part-size", "65536",
                                                     "--drain-timeout", "8"],
                    env_by_index={1: {"MOSHPITD_FAULT": "slow-send@1",
                                      "MOSHPITD_FAULT_MARKER": str(marker)}}) as swarm:
        a = swarm.daemons[0]

        def terminate_when_slow() -> float:
            deadline = time.monotonic() + 30
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.005)
            a.proc.send_signal(signal.SIGTERM)
            began = time.monotonic()
            a.proc.wait(20)
            return time.monotonic() - began

        def one(rank: int) -> torch.Tensor:
            with moshpit.Client(swarm.sockets[rank]) as c:
                (out,) = c.average([torch.full((1 << 20,), float(rank * 4))], key="mid",
                                   group_size=2, min_group_size=2, timeout=20)
                if rank == 0:  # its daemon is draining now: the next round is refused
                    with pytest.raises(moshpit.DaemonShuttingDown):
                        c.average([out], key="mid", group_size=2, timeout=5)
                return out

        results = run_parallel([lambda: one(0), lambda: one(1), terminate_when_slow])
    for out in results[:2]:
        assert isinstance(out, torch.Tensor), results
        assert torch.equal(out, torch.full((1 << 20,), 2.0))
    drained = results[2]
    assert a.proc.returncode == 0, a.log_tail()
    assert marker.exists()
    assert 0.5 < drained < 8, drained  # it waited for the slow partner, within its bound
