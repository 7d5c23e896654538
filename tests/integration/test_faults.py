"""One faulty peer in a 5-peer group, with real daemons: healthy peers finish within the round's
deadline, and every element they get back is either the weighted mean of the contributions that
arrived for it (as the result's bitmask says) or their own value, checked element by element."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import moshpit
from moshpitd.launcher import LocalSwarm
from tests.integration.helpers import run_parallel

PEERS = 5
VICTIM = 4
ELEMS = 200_000
PART = 65536  # 16384 float32 per part: each span has several parts
ROUND_BOUND = 4.0  # seconds: the 2 s deadline floor, the grace after it, and slack


def inputs(i: int) -> torch.Tensor:
    return torch.randn(ELEMS, generator=torch.Generator().manual_seed(100 + i))


def weight(i: int) -> float:
    return 1.0 + i


def faulty_swarm(factory: Callable[..., LocalSwarm], fault: str, marker: Path) -> LocalSwarm:
    env = {"MOSHPITD_FAULT": f"{fault}@1", "MOSHPITD_FAULT_MARKER": str(marker)}
    return factory(PEERS, extra_args=["--part-size", str(PART)], env_by_index={VICTIM: env})


def check_elementwise(result: torch.Tensor, info: moshpit.RoundInfo, local: torch.Tensor,
                      by_peer: dict[str, int]) -> tuple[set[int], set[int]]:
    """Returns the sets of masks seen (as peer index sets) for spans averaged and kept local."""
    got = result.numpy().astype(np.float64)
    covered = 0
    masks: set[frozenset[int]] = set()
    for start, stop, mask in info.spans:
        covered += stop - start
        if mask == 0:
            np.testing.assert_array_equal(result[start:stop].numpy(), local[start:stop].numpy())
            continue
        peers = [by_peer[info.members[b]] for b in range(len(info.members)) if mask >> b & 1]
        masks.add(frozenset(peers))
        num = sum(weight(p) * inputs(p)[start:stop].double().numpy() for p in peers)
        want = num / sum(weight(p) for p in peers)
        np.testing.assert_allclose(got[start:stop], want, rtol=1e-5, atol=1e-6)
    assert covered == ELEMS
    with_victim = {len(m) for m in masks if VICTIM in m}
    return {len(m) for m in masks}, with_victim


def run_round(clients: dict[int, moshpit.Client], key: str, timeout: float = 20
              ) -> dict[int, object]:
    ids = sorted(clients)
    results = run_parallel([
        lambda i=i: clients[i].average([inputs(i)], key=key, weight=weight(i), timeout=timeout,
                                       group_size=PEERS, min_group_size=2)
        for i in ids
    ])
    return dict(zip(ids, results, strict=True))


def peer_index(clients: dict[int, moshpit.Client]) -> dict[str, int]:
    return {c.peer_id: i for i, c in clients.items()}


def assert_healthy_ok(results: dict[int, object], clients: dict[int, moshpit.Client]
                      ) -> list[set[int]]:
    seen = []
    for i in range(PEERS):
        if i == VICTIM:
            continue
        r = results[i]
        assert not isinstance(r, Exception), (i, r)
        assert isinstance(r, list)
        info = clients[i].last_round
        assert info is not None
        assert info.seconds - info.matchmaking_seconds < ROUND_BOUND, info
        seen.append(check_elementwise(r[0], info, inputs(i), peer_index(clients))[1])
    return seen


def assert_next_round_complete(clients: dict[int, moshpit.Client], alive: list[int]) -> None:
    results = run_round({i: clients[i] for i in alive}, "after")
    for i in alive:
        r = results[i]
        assert not isinstance(r, Exception), (i, r)
        info = clients[i].last_round
        assert info is not None and info.group_size == len(alive) and info.fully_averaged, info
        check_elementwise(r[0], info, inputs(i), peer_index({j: clients[j] for j in alive}))


@pytest.mark.parametrize("fault", ["crash-before-send", "crash-mid-send", "stall-send",
                                   "crash-while-reducing", "stall-reduce"])
def test_fault_in_one_peer(swarm_factory: Callable[..., LocalSwarm], tmp_path: Path,
                           fault: str) -> None:
    swarm = faulty_swarm(swarm_factory, fault, tmp_path / "fired")
    clients = {i: moshpit.Client(s) for i, s in enumerate(swarm.sockets)}
    ids = dict(peer_index(clients))
    results = run_round(clients, "faulty")
    assert (tmp_path / "fired").exists(), "the fault never fired"
    with_victim = assert_healthy_ok(results, {**clients})
    crashed = fault.startswith("crash")
    if crashed:
        assert isinstance(results[VICTIM], moshpit.DaemonUnavailable), results[VICTIM]
        swarm.daemons[VICTIM].proc.wait(10)
    if fault == "crash-before-send":
        assert not any(with_victim), "a crashed-before-send peer contributed"
    if fault == "stall-reduce":
        assert all(with_victim), "its contributions to healthy reducers should count"
    assert ids  # every daemon answered hello
    alive = [i for i in range(PEERS) if not (crashed and i == VICTIM)]
    assert_next_round_complete(clients, alive)


VICTIM_TRAINER = textwrap.dedent("""
    import sys, torch, moshpit
    c = moshpit.Client(sys.argv[1])
    x = torch.randn(int(sys.argv[2]), generator=torch.Generator().manual_seed(104))
    print("ready", flush=True)
    c.average([x], key="faulty", weight=5.0, timeout=30, group_size=5, min_group_size=2)
""")


@pytest.mark.parametrize("how", ["trainer-cancels", "daemon-sigkill"])
def test_victim_leaves_mid_round(swarm_factory: Callable[..., LocalSwarm], tmp_path: Path,
                                 how: str) -> None:
    marker = tmp_path / "fired"
    swarm = faulty_swarm(swarm_factory, "stall-send", marker)
    clients = {i: moshpit.Client(s) for i, s in enumerate(swarm.sockets) if i != VICTIM}
    trainer = subprocess.Popen([sys.executable, "-c", VICTIM_TRAINER, swarm.sockets[VICTIM],
                                str(ELEMS)], stdout=subprocess.PIPE, text=True)
    assert trainer.stdout is not None and trainer.stdout.readline().strip() == "ready"

    def kill_on_marker() -> None:
        deadline = time.monotonic() + 20
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        if how == "trainer-cancels":
            trainer.kill()
        else:
            swarm.daemons[VICTIM].kill()

    healthy = sorted(clients)
    results = run_parallel([
        lambda i=i: clients[i].average([inputs(i)], key="faulty", weight=weight(i), timeout=20,
                                       group_size=PEERS, min_group_size=2)
        for i in healthy
    ] + [kill_on_marker])
    trainer.wait(10)
    victim_id = moshpit.Client(swarm.sockets[VICTIM]).peer_id if how != "daemon-sigkill" else None
    by_peer = peer_index(clients)
    for i, r in zip(healthy, results, strict=False):
        assert not isinstance(r, Exception), (i, r)
        info = clients[i].last_round
        assert info is not None and info.group_size == PEERS
        assert info.seconds - info.matchmaking_seconds < ROUND_BOUND, info
        missing = [m for m in info.members if m not in by_peer]
        assert len(missing) == 1
        if victim_id is not None:
            assert missing[0] == victim_id
        check_elementwise(r[0], info, inputs(i), {**by_peer, missing[0]: VICTIM})
    alive = healthy + ([VICTIM] if how == "trainer-cancels" else [])
    if how == "trainer-cancels":
        clients[VICTIM] = moshpit.Client(swarm.sockets[VICTIM])
    assert_next_round_complete(clients, alive)


def test_nan_zero_weights_and_duplicate_keys(swarm_factory: Callable[..., LocalSwarm]) -> None:
    swarm = swarm_factory(2)
    a, b = (moshpit.Client(s) for s in swarm.sockets)
    bad = torch.ones(10)
    bad[3] = float("nan")
    with pytest.raises(moshpit.InvalidRequest, match="NaN"):
        a.average([bad], key="nan", timeout=5)
    results = run_parallel([lambda c=c: c.average([torch.ones(10)], key="zero", weight=0.0,
                                                  timeout=10) for c in (a, b)])
    for r in results:
        assert isinstance(r, moshpit.AllreduceFailed) and "weight 0" in str(r), r
    c2 = moshpit.Client(swarm.sockets[0])
    first = run_parallel([lambda: a.average([torch.ones(10)], key="dup", timeout=3),
                          lambda: (time.sleep(0.5), c2.average([torch.ones(10)], key="dup",
                                                               timeout=3))])
    assert isinstance(first[1], moshpit.DuplicateRequest), first
