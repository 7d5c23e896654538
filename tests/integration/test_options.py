"""The timing options on real daemons: `--check-config` shows them with their source, and each
changes what the daemon does where that can be seen from outside."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import umsgpack

import moshpit
from moshpitd.launcher import start_daemon, wait_ready


class LateDHTPeer:
    """A UDP socket that speaks just enough Kademlia to be a bootstrap peer: it answers each
    ping `delay` seconds late, find_node at once (with no contacts), and records every RPC."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.node_id = os.urandom(20)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.02)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.rpcs: list[str] = []  # names, in arrival order
        self.changed = threading.Condition()
        self._due: list[tuple[float, bytes, tuple[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            for item in [d for d in self._due if d[0] <= now]:
                self._due.remove(item)
                self.sock.sendto(item[1], item[2])
            try:
                data, addr = self.sock.recvfrom(65536)
            except TimeoutError:
                continue
            if data[:1] != b"\x00":
                continue
            name, _args = umsgpack.unpackb(data[21:])
            reply = b"\x01" + data[1:21]
            if name == "ping":
                self._due.append((time.monotonic() + self.delay,
                                  reply + umsgpack.packb(self.node_id), addr))
            elif name == "find_node":
                self.sock.sendto(reply + umsgpack.packb([]), addr)
            with self.changed:
                self.rpcs.append(name)
                self.changed.notify_all()

    def wait_until(self, done: Callable[[list[str]], bool], timeout: float) -> list[str]:
        """The RPCs seen once `done(rpcs)` holds; fails after `timeout` seconds."""
        with self.changed:
            assert self.changed.wait_for(lambda: done(self.rpcs), timeout), self.rpcs
            return list(self.rpcs)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


def check_config(args: list[str], env: dict[str, str]) -> dict[str, dict[str, object]]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MOSHPITD_")}
    out = subprocess.run([sys.executable, "-m", "moshpitd", "--check-config", *args],
                         capture_output=True, text=True, env={**base, **env}, timeout=60)
    assert out.returncode == 0, out.stderr
    shown: dict[str, dict[str, object]] = json.loads(out.stdout)
    return shown


def test_check_config_shows_the_timing_options_with_their_source() -> None:
    shown = check_config(["--dht-rpc-timeout", "3"],
                         {"MOSHPITD_MATCHMAKING_ATTEMPT_TIMEOUT": "7.5"})
    assert shown["dht_rpc_timeout"] == {"value": 3.0, "source": "flag --dht-rpc-timeout"}
    assert shown["matchmaking_attempt_timeout"] == {
        "value": 7.5, "source": "environment variable MOSHPITD_MATCHMAKING_ATTEMPT_TIMEOUT"}
    shown = check_config([], {})
    assert shown["dht_rpc_timeout"] == {"value": 1.0, "source": "default"}
    assert shown["matchmaking_attempt_timeout"] == {"value": 5.0, "source": "default"}


@pytest.mark.parametrize("how", ["flag", "env"])
def test_dht_rpc_timeout_decides_whether_a_late_answer_counts(tmp_path: Path, how: str) -> None:
    """A bootstrap peer that answers pings 1.5 s late: with dht_rpc_timeout 3 the daemon takes
    the answer and asks the peer for contacts (find_node); with the default 1 s it would not."""
    peer = LateDHTPeer(delay=1.5)
    args, env = (["--dht-rpc-timeout", "3"], {}) if how == "flag" else \
        ([], {"MOSHPITD_DHT_RPC_TIMEOUT": "3"})
    d = start_daemon("late", tmp_path, [peer.address], extra_args=args, env=env, wait=False)
    try:
        rpcs = peer.wait_until(lambda seen: "find_node" in seen, timeout=30)
        assert rpcs[0] == "ping"
        wait_ready(d)
    finally:
        d.stop()
        peer.close()


def test_a_short_dht_rpc_timeout_gives_up_on_a_slow_peer(tmp_path: Path) -> None:
    """Answers 0.7 s late, within the default 1 s: with dht_rpc_timeout 0.3 every ping has
    timed out before its answer comes, so the daemon keeps pinging, alone, and never asks the
    peer for contacts (an accepted answer leads straight to find_node)."""
    peer = LateDHTPeer(delay=0.7)
    d = start_daemon("quick", tmp_path, [peer.address],
                     extra_args=["--dht-rpc-timeout", "0.3"], wait=False)
    try:
        rpcs = peer.wait_until(lambda seen: seen.count("ping") >= 3, timeout=30)
        assert "find_node" not in rpcs, rpcs
        wait_ready(d)
    finally:
        d.stop()
        peer.close()


def test_matchmaking_attempt_timeout_bounds_each_attempt(tmp_path: Path) -> None:
    """Alone, a request of 4 s makes one attempt with the default bound of 5 s; with a bound of
    0.5 s it declares itself again after each one, and says how many attempts it made. (An
    attempt that short needs a DHT RPC wait shorter still: the daemon refuses it otherwise.)"""
    d = start_daemon("mm", tmp_path, extra_args=["--matchmaking-attempt-timeout", "0.5",
                                                 "--dht-rpc-timeout", "0.2"])
    try:
        with moshpit.Client(d.socket) as c, pytest.raises(moshpit.GroupNotFound) as info:
            c.average([torch.ones(4)], key="nobody-else", group_size=2, timeout=4.0)
        found = re.search(r"\((\d+) attempt\(s\)", str(info.value))
        assert found, str(info.value)
        assert int(found.group(1)) >= 2, str(info.value)
    finally:
        d.stop()
