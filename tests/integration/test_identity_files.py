"""One identity per daemon, enforced where a mistake would otherwise go unseen: a second daemon
given a running daemon's key file exits at once, naming the file and the holder; a daemon whose
key was copied to another daemon hears of it in its log and its /metrics."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from moshpitd.launcher import start_daemon


def metric(daemon_metrics: str, name: str) -> float:
    with urllib.request.urlopen(f"http://{daemon_metrics}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} missing from /metrics")


def test_a_second_daemon_on_a_held_key_exits_and_the_first_goes_on(tmp_path: Path) -> None:
    first = start_daemon("d0", tmp_path)
    try:
        key = tmp_path / "d0.peer.key"
        env = {k: v for k, v in os.environ.items() if not k.startswith("MOSHPITD_")}
        second = subprocess.run(
            [sys.executable, "-m", "moshpitd", "--peer-key-file", str(key),
             "--ipc-socket", str(tmp_path / "d1.sock"), "--dht-listen", "127.0.0.1:0",
             "--grpc-listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"],
            capture_output=True, text=True, env=env, timeout=60)
        assert second.returncode == 2, second.stderr
        assert f"{key} is in use by another running daemon (pid {first.proc.pid})" in (
            second.stderr), second.stderr
        assert not (tmp_path / "d1.sock").exists()
        assert first.alive()
        assert metric(first.info["metrics"], "moshpitd_dht_own_id_elsewhere_total") == 0
        # the loop's lag is sampled all the time (one sample per 0.1 s tick)
        assert metric(first.info["metrics"], "moshpitd_event_loop_lag_seconds_count") >= 1
    finally:
        first.stop()


def test_a_copied_key_is_reported_by_the_daemon_that_meets_its_twin(tmp_path: Path) -> None:
    first = start_daemon("d0", tmp_path)
    twin_key = tmp_path / "twin.key"
    shutil.copy2(tmp_path / "d0.peer.key", twin_key)  # as if copied to a second host
    twin = start_daemon("d1", tmp_path, bootstrap=[first.dht],
                        extra_args=["--peer-key-file", str(twin_key)])
    try:
        deadline = time.monotonic() + 20
        while metric(first.info["metrics"], "moshpitd_dht_own_id_elsewhere_total") == 0:
            assert time.monotonic() < deadline, first.log_tail()
            time.sleep(0.1)
        text = first.log_path.read_text()
        assert "another daemon uses this daemon's peer key" in text, first.log_tail()
        host, port = twin.dht.rsplit(":", 1)
        assert f"from {host}:{port}" in text and f"this daemon is at {first.dht}" in text, (
            first.log_tail())
    finally:
        twin.stop()
        first.stop()
