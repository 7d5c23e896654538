"""Data-plane sessions with real daemons under a swarm key (every frame encrypted), on loopback:
the connections of one round carry the next rounds' streams, on any key, with no connect and no
handshake; a peer restarted with the same key gets new ones; a daemon killed while its sessions
carry a round is a dead stream, as before."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import moshpit
from moshpitd.launcher import LocalSwarm, start_daemon
from tests.integration.helpers import assert_close_to_mean, run_parallel, scrape, wait_until

ELEMS = 300_000


def key_args(tmp_path: Path) -> list[str]:
    path = tmp_path / "swarm.key"
    path.write_bytes(os.urandom(32).hex().encode())
    path.chmod(0o600)
    return ["--swarm-key-file", str(path)]


def streams(daemon: object) -> dict[tuple[str, str], float]:
    m = scrape(daemon)
    return {(side, how): m.get(f'moshpitd_data_streams_total{{how="{how}",side="{side}"}}', 0.0)
            for side in ("opened", "accepted") for how in ("handshake", "session")}


def inputs(i: int, rnd: int) -> torch.Tensor:
    return torch.randn(ELEMS, generator=torch.Generator().manual_seed(1000 * rnd + i))


def round_of(clients: list[moshpit.Client], key: str, rnd: int) -> None:
    n = len(clients)
    results = run_parallel([
        lambda i=i: clients[i].average([inputs(i, rnd)], key=key, weight=1.0 + i, timeout=20,
                                       group_size=n, min_group_size=n)
        for i in range(n)])
    for i, r in enumerate(results):
        assert isinstance(r, list), (i, r)
        info = clients[i].last_round
        assert info is not None and info.group_size == n and info.fully_averaged, info
        assert_close_to_mean(r[0], [inputs(j, rnd) for j in range(n)],
                             [1.0 + j for j in range(n)])


def test_later_rounds_on_any_key_run_on_the_first_round_s_sessions(
        swarm_factory: Callable[..., LocalSwarm], tmp_path: Path) -> None:
    # equal declared rates: every member owns a third (a member whose measured rate came out
    # low could own nothing, and take no stream)
    swarm = swarm_factory(3, extra_args=[*key_args(tmp_path), "--bandwidth", "1"])
    clients = [moshpit.Client(s) for s in swarm.sockets]
    round_of(clients, "a", 0)
    first = [streams(d) for d in swarm.daemons]
    for d in first:  # each daemon opened one stream to each other owner, and accepted two
        assert d["opened", "handshake"] >= 2 and d["accepted", "handshake"] >= 2, d
    for rnd, key in enumerate(["a", "b", "a"], start=1):
        round_of(clients, key, rnd)
    for before, d in zip(first, swarm.daemons, strict=True):
        after = streams(d)
        assert after["opened", "handshake"] == before["opened", "handshake"], (before, after)
        assert after["accepted", "handshake"] == before["accepted", "handshake"], after
        # one stream to each other owner and from each other sender, per round
        assert after["opened", "session"] - before["opened", "session"] == 6, after
        assert after["accepted", "session"] - before["accepted", "session"] == 6, after
        idle = scrape(d)
        assert idle['moshpitd_data_sessions_idle{side="opened"}'] == 2, idle
        assert idle['moshpitd_data_sessions_idle{side="accepted"}'] == 2, idle
    for c in clients:
        c.close()


def test_a_peer_restarted_with_its_key_gets_new_sessions(
        swarm_factory: Callable[..., LocalSwarm], tmp_path: Path) -> None:
    """Same peer key, same data port: the kept sessions to the old process are dead, and the
    next round opens new ones instead of failing or excluding the peer."""
    args = key_args(tmp_path)
    swarm = swarm_factory(2, extra_args=args)
    victim = swarm.daemons[1]
    port = int(victim.info["data"].rpartition(":")[2])
    clients = [moshpit.Client(s) for s in swarm.sockets]
    round_of(clients, "r", 0)
    before = streams(swarm.daemons[0])
    clients[1].close()
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    reborn = start_daemon("d1", swarm.workdir, [swarm.daemons[0].dht], swarm.log_level,
                          [*args, "--data-port", str(port)])
    swarm.daemons[1] = reborn
    assert reborn.info["peer_id"] == victim.info["peer_id"]
    assert reborn.info["data"] == victim.info["data"]
    clients[1] = moshpit.Client(reborn.socket)
    started = time.monotonic()
    round_of(clients, "r", 1)
    after = streams(swarm.daemons[0])
    assert after["opened", "handshake"] == before["opened", "handshake"] + 1, (before, after)
    assert time.monotonic() - started < 15
    round_of(clients, "r", 2)  # and the new sessions are kept in turn
    assert streams(swarm.daemons[0])["opened", "session"] == after["opened", "session"] + 1
    for c in clients:
        c.close()


@pytest.mark.parametrize("fault", ["crash-mid-send"])
def test_a_daemon_killed_mid_round_on_kept_sessions_is_a_dead_stream(
        swarm_factory: Callable[..., LocalSwarm], tmp_path: Path, fault: str) -> None:
    """The victim crashes in its second round, whose streams all run on the first round's
    sessions: the others finish at once, their results the mean of whom their masks name."""
    marker = tmp_path / "fired"
    swarm = swarm_factory(3, extra_args=[*key_args(tmp_path), "--part-size", "65536"],
                          env_by_index={2: {"MOSHPITD_FAULT": f"{fault}@2",
                                            "MOSHPITD_FAULT_MARKER": str(marker)}})
    ids = {d.info["peer_id"]: i for i, d in enumerate(swarm.daemons)}
    clients = [moshpit.Client(s) for s in swarm.sockets]
    round_of(clients, "k", 0)
    results = run_parallel([
        lambda i=i: clients[i].average([inputs(i, 1)], key="k", weight=1.0 + i, timeout=20,
                                       group_size=3, min_group_size=3)
        for i in range(3)])
    assert marker.exists(), "the fault never fired"
    assert isinstance(results[2], moshpit.DaemonUnavailable), results[2]
    for i in (0, 1):
        r, info = results[i], clients[i].last_round
        assert isinstance(r, list) and info is not None and info.group_size == 3, (i, r)
        assert info.seconds - info.matchmaking_seconds < 5.0, info
        # to the other healthy peer at least (the victim's may be gone when the round starts)
        assert streams(swarm.daemons[i])["opened", "session"] >= 1
        members = [ids[m] for m in info.members]
        got = r[0].double()
        for start, stop, mask in info.spans:
            peers = [members[b] for b in range(3) if mask >> b & 1]
            if not peers:
                assert torch.equal(r[0][start:stop], inputs(i, 1)[start:stop])
                continue
            want = sum((1.0 + p) * inputs(p, 1)[start:stop].double() for p in peers)
            want = want / sum(1.0 + p for p in peers)
            torch.testing.assert_close(got[start:stop], want, rtol=1e-5, atol=1e-6)
    wait_until(lambda: swarm.daemons[2].proc.poll() is not None, 10, "the victim's exit")
    for c in clients:
        c.close()
