"""The daemons' /metrics as Prometheus itself sees it: promtool's linter, and a real server
scraping two daemons on loopback."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

import moshpit
from moshpitd.launcher import LocalSwarm
from tests.integration.helpers import run_parallel

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")


def average_once(swarm: LocalSwarm, key: str) -> None:
    """One averaging round between all of the swarm's daemons, one client on each."""
    clients: list[moshpit.Client] = []

    def call(i: int) -> list[torch.Tensor]:
        return clients[i].average([torch.full((100,), float(i))], key=key, timeout=20,
                                  group_size=len(clients))

    try:
        for path in swarm.sockets:
            clients.append(moshpit.Client(path))
        results = run_parallel([partial(call, i) for i in range(len(clients))], timeout=40)
        for r in results:
            assert not isinstance(r, Exception), r
        for c in clients:
            assert c.last_round is not None and c.last_round.group_size == len(clients)
    finally:
        for c in clients:
            c.close()


def fetch(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        body: bytes = resp.read()
        return body


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not on PATH (Debian package prometheus)")
def test_metrics_pass_promtool_lint(swarm_factory: Callable[..., LocalSwarm]) -> None:
    swarm = swarm_factory(2)
    average_once(swarm, "promtool")
    for d in swarm.daemons:
        body = fetch(f"http://{d.info['metrics']}/metrics")
        assert b'moshpitd_rounds_total{result="ok"} 1.0' in body
        assert PROMTOOL is not None
        out = subprocess.run([PROMTOOL, "check", "metrics"], input=body, capture_output=True,
                             timeout=30)
        report = (out.stdout + out.stderr).decode(errors="replace").strip()
        assert out.returncode == 0 and report == "", (
            f"promtool check metrics on {d.name}: exit {out.returncode}\n{report}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrometheusServer:
    """A throwaway Prometheus on a loopback port with its own config and storage."""

    def __init__(self, workdir: Path, targets: list[str]) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "prometheus.yml").write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                       "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "moshpitd", "static_configs": [
                {"targets": targets}]}],
        }, indent=2))
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    @property
    def log_path(self) -> Path:
        return self.workdir / "prometheus.log"

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def start(self, timeout: float = 20.0) -> None:
        """Starts it and waits until /-/ready; a port taken between picking and binding it
        means another try with a new one."""
        assert PROMETHEUS is not None
        for _ in range(3):
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen([
                    PROMETHEUS, f"--config.file={self.workdir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={self.workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--log.level=warn", "--storage.tsdb.retention.time=1h",
                    "--storage.tsdb.wal-compression",
                ], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    if fetch(f"{self.url}/-/ready", timeout=1).strip():
                        return
                except OSError:
                    time.sleep(0.1)
            if self.proc.poll() is None:
                self.stop()
                raise AssertionError(f"prometheus not ready in {timeout} s:\n{self.log_tail()}")
            if "address already in use" not in self.log_tail():
                raise AssertionError(f"prometheus exited with {self.proc.returncode}:\n"
                                     f"{self.log_tail()}")
        raise AssertionError(f"prometheus found no free port:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def api(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        reply = json.loads(fetch(f"{self.url}/api/v1/{path}{query}"))
        assert reply["status"] == "success", reply
        return reply["data"]

    def query(self, expr: str) -> dict[str, float]:
        """An instant query's vector as {instance: value}."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return {r["metric"].get("instance", ""): float(r["value"][1]) for r in data["result"]}

    def wait_for(self, what: str, check: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Polls `check` until it returns something truthy; its last value on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            got = check()
            if got or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert got, f"prometheus: {what} not within {timeout} s; last {got!r}\n{self.log_tail()}"
        return got


@pytest.mark.skipif(PROMETHEUS is None,
                    reason="prometheus server not on PATH (Debian package prometheus)")
def test_prometheus_scrapes_both_daemons(swarm_factory: Callable[..., LocalSwarm],
                                         tmp_path: Path) -> None:
    swarm = swarm_factory(2)
    targets = [d.info["metrics"] for d in swarm.daemons]
    prom = PrometheusServer(tmp_path / "prometheus", targets)
    try:
        prom.start()

        def targets_up() -> dict[str, str]:
            active = prom.api("targets", state="active")["activeTargets"]
            health = {t["labels"]["instance"]: t["health"] for t in active}
            return health if sorted(health) == sorted(targets) and all(
                h == "up" for h in health.values()) else {}

        prom.wait_for("both targets up", targets_up)
        # scraped before any round: every result's series exists from the start, at 0 (so
        # rate() and alerts see the first increment)
        built = prom.query("moshpitd_build_info")
        assert sorted(built) == sorted(targets), built
        assert prom.query('moshpitd_rounds_total{result="ok"}') == {t: 0.0 for t in targets}

        average_once(swarm, "scraped")

        def rounds_seen() -> dict[str, float]:
            got = prom.query('moshpitd_rounds_total{job="moshpitd",result="ok"}')
            return got if sorted(got) == sorted(targets) and all(
                v > 0 for v in got.values()) else {}

        ok = prom.wait_for("moshpitd_rounds_total > 0 on both daemons", rounds_seen)
        assert ok == {t: 1.0 for t in targets}, ok
        assert prom.query("sum(moshpitd_rounds_total)") == {"": 2.0}
        counts = prom.wait_for("round durations", lambda: prom.query(
            "moshpitd_round_duration_seconds_count > 0"))
        assert counts == {t: 1.0 for t in targets}, counts
        up = prom.query('up{job="moshpitd"}')
        assert up == {t: 1.0 for t in targets}, up
    finally:
        prom.stop()
