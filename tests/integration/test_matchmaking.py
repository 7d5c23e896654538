"""Matchmaking (docs/architecture.md, "Matchmaking"). Protocol tests drive Matchmakers of
MoshpitNodes running in this process, in one event loop (every Join still travels over gRPC);
fault tests run real daemons: a leader killed under its followers, daemons whose clocks disagree
by a minute."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

import moshpit
from moshpitd.allreduce.group import Group
from moshpitd.launcher import DaemonProcess, LocalSwarm
from moshpitd.matchmaking.errors import GroupNotFound
from moshpitd.matchmaking.matchmaker import Matchmaker
from moshpitd.matchmaking.request import MatchRequest, Self
from moshpitd.node import MoshpitNode
from moshpitd.node_config import NodeConfig
from tests.integration.helpers import assert_close_to_mean, run_parallel
from tests.integration.test_grid import check_round, last

T = TypeVar("T")
SCHEMA = b"\x5a" * 32


# --- in-process nodes ----------------------------------------------------------------------
def run_nodes(n: int, scenario: Callable[[list[MoshpitNode]], Awaitable[T]]) -> T:
    async def main() -> T:
        first = MoshpitNode(NodeConfig())
        nodes = [first]
        try:
            await first.start()
            boot = (("127.0.0.1", first.dht_addr[1]),)
            nodes += [MoshpitNode(NodeConfig(bootstrap=boot)) for _ in range(n - 1)]
            await asyncio.gather(*(node.start() for node in nodes[1:]))
            async with asyncio.timeout(40):
                return await scenario(nodes)
        finally:
            for node in nodes:
                await node.stop()
    return asyncio.run(main())


def matchmaker(node: MoshpitNode, key: str = "k", *, weight: float = 1.0, target: int = 4,
               min_size: int = 2, attempt: float = 10.0, settle: float = 10.0) -> Matchmaker:
    """A peer looking for a group under key, reachable through its node's Join service.
    The default settle time is long: such a leader assembles only at its target size or at
    its deadline."""
    request = MatchRequest(key, SCHEMA, weight, target, min_size, attempt_seconds=attempt,
                           settle_seconds=settle)
    mm = Matchmaker(Self(node.peer_id, node.grpc_endpoint, node.data_endpoint, auth=node.auth),
                    node.dht,
                    node.pool, request, probe=node._probe)
    node.matchmakers[key] = mm
    return mm


async def search(node: MoshpitNode, mm: Matchmaker, timeout: float) -> Group:
    try:
        return await mm.find_group(timeout)
    finally:
        node.matchmakers.pop(mm.req.key, None)


async def search_all(nodes: list[MoshpitNode], timeout: float, **kw: Any
                     ) -> tuple[list[Any], float]:
    """Every node looks for a group at once: each one's group or error, and the seconds."""
    mms = [matchmaker(node, **kw) for node in nodes]
    started = time.monotonic()
    out = await asyncio.gather(*(search(n, m, timeout) for n, m in zip(nodes, mms, strict=True)),
                               return_exceptions=True)
    return list(out), time.monotonic() - started


def one_group(outcomes: list[Any], size: int) -> None:
    assert all(isinstance(o, Group) for o in outcomes), outcomes
    assert len({o.group_id for o in outcomes}) == 1 and len(outcomes[0].members) == size


def offset_versions(node: MoshpitNode, seconds: float) -> None:
    """This node's DHT versions come from a clock `seconds` off (they are wall-clock ns)."""
    real = node.dht.next_version
    node.dht.next_version = lambda: real() + int(seconds * 1e9)  # type: ignore[method-assign]


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


def test_leader_joining_an_earlier_leader_brings_its_followers(
        caplog: pytest.LogCaptureFixture) -> None:
    """A and B form a group; then C and D declare with clocks 30 s behind, so they rank
    first. A joins C and redirects B there: all four end in C's group, and B got there by
    A's suggestion (it asked C because A sent it, not by finding C itself later)."""
    caplog.set_level(logging.DEBUG, logger="moshpitd.matchmaking.matchmaker")

    async def scenario(nodes: list[MoshpitNode]) -> tuple[list[Group], list[bytes]]:
        mms = [matchmaker(node, target=4) for node in nodes]
        a, b, c, d = nodes
        tasks = [asyncio.create_task(search(a, mms[0], 10))]
        await until(lambda: mms[0]._version != 0)
        tasks.append(asyncio.create_task(search(b, mms[1], 10)))
        await until(lambda: b.peer_id in mms[0].leading.followers)
        for late in (c, d):
            offset_versions(late, -30)
        tasks.append(asyncio.create_task(search(c, mms[2], 10)))
        await until(lambda: mms[2]._version != 0)
        tasks.append(asyncio.create_task(search(d, mms[3], 10)))
        started = time.monotonic()
        groups = await asyncio.gather(*tasks)
        assert time.monotonic() - started < 5  # at the target size, long before any deadline
        return list(groups), [node.peer_id for node in nodes]

    groups, ids = run_nodes(4, scenario)
    assert len({g.group_id for g in groups}) == 1
    assert groups[0].members[0].peer_id == ids[2]  # C leads
    assert {m.peer_id for m in groups[0].members} == set(ids)
    a, b, c = (p.hex()[:6] for p in ids[:3])
    lines = [r.getMessage() for r in caplog.records]
    assert f"{b}: join {a} -> Candidate" in lines, lines  # A answered: go to C
    assert f"{b}: join {c} -> Group" in lines, lines


def test_assembles_at_once_at_target_size() -> None:
    groups, seconds = run_nodes(4, lambda nodes: search_all(nodes, 10, target=4))
    one_group(groups, 4)
    assert seconds < 3, seconds  # neither the 10 s deadline nor the 10 s settle time


def test_assembles_at_deadline_with_min_size_and_not_below() -> None:
    """Below the target, with nobody else coming: the group assembles at the leader's deadline
    if it has min_size members; with fewer, every peer gives up at its deadline."""
    groups, seconds = run_nodes(
        3, lambda nodes: search_all(nodes, 1.5, target=8, min_size=3, attempt=1.5))
    one_group(groups, 3)  # every follower too: it got the group before its own deadline
    assert 1.2 <= seconds < 3.0, seconds  # at the deadline, less a little for the GroupInfo
    outcomes, seconds = run_nodes(
        2, lambda nodes: search_all(nodes, 1.0, target=8, min_size=3, attempt=1.0))
    assert all(isinstance(o, GroupNotFound) for o in outcomes), outcomes
    assert 0.9 <= seconds < 2.5, seconds


def test_a_follower_whose_attempt_ends_is_released_and_rejoins(
        caplog: pytest.LogCaptureFixture) -> None:
    """The group needs 3 and only 2 wait: the follower's attempt ends first. Its leader lets it
    go at its declared deadline instead of holding it until it hangs up on its own (a last
    member joining as it hangs up would form a group it has left). It asks again in its next
    attempt, so when the third peer comes, after the follower would have hung up, all three
    form one group and nobody gave up on an accepted leader."""
    caplog.set_level(logging.INFO, logger="moshpitd.matchmaking.matchmaker")

    async def scenario(nodes: list[MoshpitNode]) -> list[Group]:
        lead, follow, last = nodes
        # (a declaration outliving ours by two attempts is ignored: 4 s is within reach)
        mms = [matchmaker(lead, target=3, min_size=3, attempt=4.0),
               matchmaker(follow, target=3, min_size=3, attempt=1.5),
               matchmaker(last, target=3, min_size=3, attempt=4.0)]
        tasks = [asyncio.create_task(search(lead, mms[0], 10))]
        await until(lambda: mms[0]._version != 0)
        tasks.append(asyncio.create_task(search(follow, mms[1], 10)))
        followers = mms[0].leading.followers
        await until(lambda: follow.peer_id in followers)
        accepted, first = time.monotonic(), followers[follow.peer_id]
        await until(lambda: followers.get(follow.peer_id) is not first, timeout=2.5)
        assert time.monotonic() - accepted < 2.0  # before its 1 s patience past the deadline
        await until(lambda: follow.peer_id in followers, timeout=3.0)  # its next attempt
        await asyncio.sleep(max(accepted + 2.7 - time.monotonic(), 0))
        tasks.append(asyncio.create_task(search(last, mms[2], 10)))
        return list(await asyncio.gather(*tasks))

    one_group(run_nodes(3, scenario), 3)
    lines = [r.getMessage() for r in caplog.records]
    assert not any("did not assemble" in line for line in lines), lines


def test_joins_carry_their_declarations_so_nobody_reads_the_key_to_vet() -> None:
    """Two followers whose declarations never reach the DHT (their stores are dropped) still
    form a group with the leader they read: each join carries its signed declaration, and the
    GroupInfo's admissions carry them on to the other members, so no member reads the key
    again to vet a joiner or an entry (once a round trip each on a WAN)."""
    async def scenario(nodes: list[MoshpitNode]) -> tuple[list[Group], list[int]]:
        lead, *followers = nodes
        mms = [matchmaker(node, target=3) for node in nodes]
        for node in followers:
            async def dropped(*args: Any, **kwargs: Any) -> int:
                return 0
            node.dht.store_sub = dropped  # type: ignore[method-assign]
        tasks = [asyncio.create_task(search(lead, mms[0], 10))]
        await until(lambda: mms[0]._version != 0)
        tasks += [asyncio.create_task(search(n, m, 10))
                  for n, m in zip(followers, mms[1:], strict=True)]
        groups = list(await asyncio.gather(*tasks))
        return groups, [mm.book.reads for mm in mms]

    groups, reads = run_nodes(3, scenario)
    one_group(groups, 3)
    assert reads == [0, 0, 0], reads


def test_peers_declared_at_the_same_instant_all_form_groups() -> None:
    """Nine peers declare with the very same version, so only peer ids order them, and start
    in the same loop iteration: no wait cycle forms, everyone is in a group of 2..3 well before
    the deadline, and every member agrees on its group."""
    async def scenario(nodes: list[MoshpitNode]) -> tuple[list[Any], float]:
        same = time.time_ns()
        ids.extend(node.peer_id for node in nodes)
        for node, pin in zip(nodes, pins, strict=True):
            real = node.dht.next_version
            node.dht.next_version = (  # type: ignore[method-assign]
                lambda real=real, pin=pin: pin.pop() if pin else real())
            pin.append(same)
        return await search_all(nodes, 10, target=3, settle=0.5)

    ids: list[bytes] = []
    pins: list[list[int]] = [[] for _ in range(9)]
    groups, seconds = run_nodes(9, scenario)
    assert not any(pins)  # every declaration carried the same version
    assert seconds < 5, seconds  # nobody waited for the 10 s deadline
    by_id: dict[bytes, set[bytes]] = {}
    for me, g in zip(ids, groups, strict=True):
        assert isinstance(g, Group), g
        members = {m.peer_id for m in g.members}
        assert me in members
        assert by_id.setdefault(g.group_id, members) == members
        assert 2 <= len(members) <= 3
    assert sum(len(m) for m in by_id.values()) == 9  # each peer in exactly one group


# --- real daemons --------------------------------------------------------------------------
def wait_for_log(daemon: DaemonProcess, text: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in daemon.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"{daemon.name} never logged {text!r}"
        time.sleep(0.01)


def test_followers_of_a_killed_leader_retry_and_average(
        swarm_factory: Callable[..., LocalSwarm]) -> None:
    """The leader has taken both followers and waits for a fourth member (its
    min_group_size) when it is SIGKILLed: they regroup without it and average in time."""
    swarm = swarm_factory(3, log_level="DEBUG")
    ids = [d.info["peer_id"] for d in swarm.daemons]
    clients = [moshpit.Client(s) for s in swarm.sockets]
    inputs = {p: torch.randn(5000, generator=torch.Generator().manual_seed(i))
              for i, p in enumerate(ids)}
    weights = {p: 1.0 + 2 * i for i, p in enumerate(ids)}
    leader = swarm.daemons[2]

    def call(i: int, **kw: Any) -> list[torch.Tensor]:
        return clients[i].average([inputs[ids[i]]], key="lead", weight=weights[ids[i]],
                                  group_size=4, timeout=20, **kw)

    with ThreadPoolExecutor(3) as pool:
        doomed = pool.submit(call, 2, min_group_size=4)
        wait_for_log(leader, f"{ids[2][:6]}: 0 candidates")  # declared first: it leads
        started = time.monotonic()
        calls = [pool.submit(call, i) for i in (0, 1)]
        for i in (0, 1):
            wait_for_log(swarm.daemons[i], f"{ids[i][:6]}: {ids[2][:6]} answers ACCEPTED")
        leader.kill()
        results = [c.result(30) for c in calls]
        finished = time.monotonic()
        assert isinstance(doomed.exception(10), moshpit.DaemonUnavailable)
    for i in (0, 1):
        assert f"join {ids[2][:8]} failed" in swarm.daemons[i].log_path.read_text()
        group = check_round(results[i][0], clients[i].last_round, ids[i], inputs, weights)
        assert group == set(ids[:2]) and last(clients[i]).fully_averaged
    assert finished - started < 5.0  # within the followers' first attempt (5 s)


SKEWED_CLOCK = """
import os, time
_offset_ns = int(float(os.environ.get("MOSHPIT_TEST_CLOCK_OFFSET", "0")) * 1e9)
if _offset_ns:
    _time_ns = time.time_ns
    time.time_ns = lambda: _time_ns() + _offset_ns
"""


def test_daemons_with_skewed_clocks_match(swarm_factory: Callable[..., LocalSwarm],
                                          tmp_path: Path) -> None:
    """DHT record versions are the writers' wall-clock ns. Four daemons whose version clocks
    are -30 s, 0, +15 s and +30 s off (a test hook: a sitecustomize shifts time.time_ns, which
    moshpitd reads only for versions), released by one barrier, still form one group and
    average exactly, with and without the grid; the one whose clock is behind leads, since
    it looks earliest."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SKEWED_CLOCK)
    path = os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))
    offsets = [0.0, -30.0, 15.0, 30.0]
    envs = {i: {"PYTHONPATH": path, "MOSHPIT_TEST_CLOCK_OFFSET": str(o)}
            for i, o in enumerate(offsets)}
    shown = subprocess.run([sys.executable, "-c", "import time; print(time.time_ns())"],
                           env={**os.environ, **envs[1]}, capture_output=True, text=True,
                           check=True)
    assert abs(int(shown.stdout) / 1e9 - time.time() + 30) < 5  # the hook takes effect
    swarm = swarm_factory(4, env_by_index=envs)
    ids = [d.info["peer_id"] for d in swarm.daemons]
    clients = [moshpit.Client(s) for s in swarm.sockets]
    inputs = {p: torch.randn(3000, generator=torch.Generator().manual_seed(i))
              for i, p in enumerate(ids)}
    weights = {p: 1.0 + i for i, p in enumerate(ids)}
    gate = threading.Barrier(4)  # they declare at the same moment, by different clocks

    def call(i: int) -> list[torch.Tensor]:
        gate.wait()
        return clients[i].average([inputs[ids[i]]], key="skew", weight=weights[ids[i]],
                                  group_size=4, timeout=20)

    results = run_parallel([lambda i=i: call(i) for i in range(4)])
    for i, r in enumerate(results):
        assert not isinstance(r, BaseException), (i, r)
        assert check_round(r[0], clients[i].last_round, ids[i], inputs, weights) == set(ids)
        assert last(clients[i]).members[0] == ids[1]
    grid = run_parallel([
        lambda i=i: clients[i].average([inputs[ids[i]]], key="skewgrid", grid=(2, 2), rounds=2,
                                       weight=weights[ids[i]], initial_coords=(i // 2, i % 2),
                                       timeout=20)
        for i in range(4)
    ])
    for i, r in enumerate(grid):
        assert not isinstance(r, BaseException), (i, r)
        assert last(clients[i]).group_sizes == (2, 2)
        assert_close_to_mean(r[0], [inputs[p] for p in ids], [weights[p] for p in ids])
