"""One faulty peer in a 5-peer group, with real daemons.

For each fault: the group really has 5 members (min_group_size=5: a split group fails the test);
each part of a healthy peer's result is averaged over exactly the members the fault allows
(every healthy member always; the victim where it delivered; nobody where the victim reduced and
failed), and every element is checked against the weighted mean of those members' inputs, or
the peer's own value where the mask is 0; healthy peers finish before the round's deadline when
the fault is a dropped connection or an abort (the healthy daemons' metrics name that reason,
never "timeout"), else within the round's hard deadline (twice its budget); the victim's daemon,
if alive, then joins a round that completes."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

import moshpit
from moshpitd.allreduce.deadlines import DeadlinePolicy
from moshpitd.allreduce.layout import Run, plan_parts, span_bounds
from moshpitd.clock import RoundClock
from moshpitd.launcher import LocalSwarm
from tests.integration.helpers import active_keys, run_parallel, wait_until

PEERS = 5
VICTIM = 4
ELEMS = 200_000
PART = 65536  # 16384 float32 per part: each member's span has 3 parts
ALL = frozenset(range(PEERS))
HEALTHY = ALL - {VICTIM}
LOCAL: frozenset[int] = frozenset()  # a part that kept the peer's own values


def _round_timing() -> tuple[float, float]:
    """The budget and grace a fresh daemon's clock gives a round of these inputs."""
    wire = 4 * ELEMS * 4 * (PEERS - 1) // PEERS  # sent plus received, codec none
    d = RoundClock(3600.0, 5.0, DeadlinePolicy()).allreduce(wire)
    return d.budget, d.grace


BUDGET, GRACE = _round_timing()
HARD_BOUND = 2 * BUDGET + GRACE + 0.5  # hard deadline, the owners' grace after it, slack


def masks(*sets: frozenset[int]) -> frozenset[frozenset[int]]:
    return frozenset(sets)


@dataclass(frozen=True)
class Rule:
    """The contributor sets a healthy peer may see: on parts the victim reduced, on the first
    part of every other member's span, on its later parts. `excluded_as`: the one reason the
    healthy daemons count for excluding the victim (None: it is never excluded; `maybe`: it
    may have delivered everything before it failed, leaving nothing to count). `at_once`: the
    fault is detected when it happens, well before the round's deadline. `cut`: every other
    member's span has parts with the victim and parts without. `local_parts`: how many of the
    victim's parts keep local values."""

    victim_owned: frozenset[frozenset[int]]
    first: frozenset[frozenset[int]]
    later: frozenset[frozenset[int]]
    excluded_as: str | None
    maybe: bool = False
    at_once: bool = False
    cut: bool = False
    local_parts: int | None = None
    part: int = PART


RULES = {
    "crash-before-send": Rule(masks(LOCAL), masks(HEALTHY), masks(HEALTHY), "disconnected",
                              at_once=True),
    "crash-mid-send": Rule(masks(LOCAL, ALL), masks(HEALTHY, ALL), masks(HEALTHY, ALL),
                           "disconnected", at_once=True),
    "stall-send": Rule(masks(ALL), masks(ALL), masks(HEALTHY), "timeout", cut=True),
    "slow-send": Rule(masks(ALL), masks(ALL), masks(ALL), None),
    # 40 parts per span at 0.3 s each: 12 s to send everything, cut at twice the 2 s budget
    "trickle-send": Rule(masks(ALL), masks(ALL), masks(ALL, HEALTHY), "timeout", cut=True,
                         part=4096),
    "crash-while-reducing": Rule(masks(LOCAL), masks(HEALTHY, ALL), masks(HEALTHY, ALL),
                                 "disconnected", maybe=True, at_once=True),
    "stall-reduce": Rule(masks(LOCAL), masks(ALL), masks(ALL), None),
    "poison-results": Rule(masks(LOCAL, ALL), masks(ALL), masks(ALL), None, local_parts=1),
    # the victim stalls after its first part to every owner (stall-send), then leaves: it
    # sends ABORT (LEFT) on every stream, behind whatever results it had queued, and they all
    # go out before its round returns; the healthy daemons count it as aborted, never also as
    # a dropped stream
    "trainer-cancels": Rule(masks(LOCAL, ALL), masks(ALL), masks(HEALTHY), "aborted",
                            at_once=True, cut=True),
    "daemon-sigkill": Rule(masks(LOCAL, ALL), masks(ALL, HEALTHY), masks(HEALTHY),
                           "disconnected", at_once=True),
}


def inputs(i: int) -> torch.Tensor:
    return torch.randn(ELEMS, generator=torch.Generator().manual_seed(100 + i))


def weight(i: int) -> float:
    return 1.0 + i


def faulty_swarm(factory: Callable[..., LocalSwarm], fault: str, marker: Path,
                 part: int = PART) -> LocalSwarm:
    env = {"MOSHPITD_FAULT": f"{fault}@1", "MOSHPITD_FAULT_MARKER": str(marker)}
    return factory(PEERS, extra_args=["--part-size", str(part), "--bandwidth", "1"],
                   env_by_index={VICTIM: env})  # equal spans, as the tests plan them


def peer_ids(swarm: LocalSwarm) -> dict[str, int]:
    return {d.info["peer_id"]: i for i, d in enumerate(swarm.daemons)}


def check_elementwise(result: torch.Tensor, info: moshpit.RoundInfo, local: torch.Tensor,
                      members: list[int]) -> None:
    """`members[b]`: the peer index of bit b of a mask."""
    assert torch.isfinite(result).all(), "a result holds NaN or Inf"
    got = result.numpy().astype(np.float64)
    covered = 0
    for start, stop, mask in info.spans:
        assert start == covered, info.spans
        covered = stop
        if mask == 0:
            np.testing.assert_array_equal(result[start:stop].numpy(), local[start:stop].numpy())
            continue
        peers = [members[b] for b in range(len(members)) if mask >> b & 1]
        num = sum(weight(p) * inputs(p)[start:stop].double().numpy() for p in peers)
        want = num / sum(weight(p) for p in peers)
        np.testing.assert_allclose(got[start:stop], want, rtol=1e-5, atol=1e-6)
    assert covered == ELEMS


def check_healthy(result: object, info: moshpit.RoundInfo | None, me: int, ids: dict[str, int],
                  rule: Rule) -> None:
    assert isinstance(result, list), (me, result)
    assert info is not None and info.group_size == PEERS, info
    members = [ids[m] for m in info.members]
    check_elementwise(result[0], info, inputs(me), members)
    seconds = info.seconds - info.matchmaking_seconds
    bound = BUDGET if rule.at_once else HARD_BOUND
    assert seconds < bound, f"peer {me}: {seconds:.2f} s in the round, bound {bound:.2f} s"
    victim = members.index(VICTIM)
    bounds = span_bounds(ELEMS, [1.0] * PEERS)
    with_victim: dict[int, list[bool]] = {}  # per other owner, in part order
    local = 0
    for p in plan_parts([Run("float32", ELEMS, (0,))], [1.0] * PEERS, rule.part):
        mask = next(m for lo, hi, m in info.spans if lo <= p.start and p.stop <= hi)
        peers = frozenset(members[b] for b in range(PEERS) if mask >> b & 1)
        if p.owner == victim:
            allowed, local = rule.victim_owned, local + (not peers)
        else:
            allowed = rule.first if p.start == bounds[p.owner] else rule.later
            with_victim.setdefault(p.owner, []).append(VICTIM in peers)
        assert peers in allowed, (me, p, sorted(peers), info.spans)
    for owner, seq in with_victim.items():  # a sender's parts arrive in order
        assert seq == sorted(seq, reverse=True), (me, owner, seq)
        if rule.cut:
            assert any(seq) and not all(seq), (me, owner, seq)
    if rule.local_parts is not None:
        assert local == rule.local_parts, (me, local, info.spans)


def excluded_reasons(swarm: LocalSwarm, peers: list[int]) -> set[str]:
    """The faults the daemons counted in moshpitd_excluded_parts_total, over these peers."""
    total: dict[str, float] = {}
    for i in peers:
        url = f"http://{swarm.daemons[i].info['metrics']}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = resp.read().decode()
        for reason, value in re.findall(
                r'^moshpitd_excluded_parts_total\{fault="(\w+)"\} (\S+)$', body, re.M):
            total[reason] = total.get(reason, 0.0) + float(value)
    return {reason for reason, n in total.items() if n > 0}


def check_reasons(swarm: LocalSwarm, healthy: list[int], rule: Rule) -> None:
    want = {rule.excluded_as} if rule.excluded_as else set()
    got = excluded_reasons(swarm, healthy)
    assert got == want or (rule.maybe and not got), (got, want)


def average(client: moshpit.Client, i: int, key: str, size: int) -> list[torch.Tensor]:
    return client.average([inputs(i)], key=key, weight=weight(i), timeout=20,
                          group_size=size, min_group_size=size)


def assert_next_round_complete(clients: dict[int, moshpit.Client], alive: list[int],
                               ids: dict[str, int]) -> None:
    results = run_parallel([lambda i=i: average(clients[i], i, "after", len(alive))
                            for i in alive])
    for i, r in zip(alive, results, strict=True):
        assert isinstance(r, list), (i, r)
        info = clients[i].last_round
        assert info is not None and info.group_size == len(alive) and info.fully_averaged, info
        check_elementwise(r[0], info, inputs(i), [ids[m] for m in info.members])


@pytest.mark.parametrize("fault", ["crash-before-send", "crash-mid-send", "stall-send",
                                   "slow-send", "trickle-send", "crash-while-reducing",
                                   "stall-reduce", "poison-results"])
def test_fault_in_one_peer(swarm_factory: Callable[..., LocalSwarm], tmp_path: Path,
                           fault: str) -> None:
    rule = RULES[fault]
    swarm = faulty_swarm(swarm_factory, fault, tmp_path / "fired", rule.part)
    ids = peer_ids(swarm)
    clients = {i: moshpit.Client(s) for i, s in enumerate(swarm.sockets)}
    results = run_parallel([lambda i=i: average(clients[i], i, "faulty", PEERS)
                            for i in range(PEERS)])
    assert (tmp_path / "fired").exists(), "the fault never fired"
    healthy = sorted(HEALTHY)
    for i in healthy:
        check_healthy(results[i], clients[i].last_round, i, ids, rule)
    check_reasons(swarm, healthy, rule)
    crashed = fault.startswith("crash")
    if crashed:
        assert isinstance(results[VICTIM], moshpit.DaemonUnavailable), results[VICTIM]
        swarm.daemons[VICTIM].proc.wait(10)
    else:  # whatever it got back is still a real mean or its own value
        info = clients[VICTIM].last_round
        assert isinstance(results[VICTIM], list) and info is not None, results[VICTIM]
        check_elementwise(results[VICTIM][0], info, inputs(VICTIM),
                          [ids[m] for m in info.members])
    alive = [i for i in range(PEERS) if not (crashed and i == VICTIM)]
    assert_next_round_complete(clients, alive, ids)


VICTIM_TRAINER = textwrap.dedent("""
    import sys, torch, moshpit
    c = moshpit.Client(sys.argv[1])
    x = torch.randn(int(sys.argv[2]), generator=torch.Generator().manual_seed(104))
    print("ready", flush=True)
    c.average([x], key="faulty", weight=5.0, timeout=30, group_size=5, min_group_size=5)
""")


@pytest.mark.parametrize("how", ["trainer-cancels", "daemon-sigkill"])
def test_victim_leaves_mid_round(swarm_factory: Callable[..., LocalSwarm], tmp_path: Path,
                                 how: str) -> None:
    """The victim stalls after its first part to every owner (the marker fires then) and its
    trainer or daemon dies: healthy peers must notice that, not wait for the deadline."""
    rule = RULES[how]
    marker = tmp_path / "fired"
    swarm = faulty_swarm(swarm_factory, "stall-send", marker)
    ids = peer_ids(swarm)
    clients = {i: moshpit.Client(s) for i, s in enumerate(swarm.sockets) if i != VICTIM}
    trainer = subprocess.Popen([sys.executable, "-c", VICTIM_TRAINER, swarm.sockets[VICTIM],
                                str(ELEMS)], stdout=subprocess.PIPE, text=True)
    assert trainer.stdout is not None and trainer.stdout.readline().strip() == "ready"

    def kill_on_marker() -> bool:
        deadline = time.monotonic() + 20
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        fired = marker.exists()
        if how == "trainer-cancels":
            trainer.kill()
        else:
            swarm.daemons[VICTIM].kill()
        return fired

    healthy = sorted(clients)
    results = run_parallel([lambda i=i: average(clients[i], i, "faulty", PEERS)
                            for i in healthy] + [kill_on_marker])
    trainer.wait(10)
    assert results[-1] is True, "the fault never fired"
    for i, r in zip(healthy, results, strict=False):
        check_healthy(r, clients[i].last_round, i, ids, rule)
    check_reasons(swarm, healthy, rule)
    alive = healthy + ([VICTIM] if how == "trainer-cancels" else [])
    if how == "trainer-cancels":
        clients[VICTIM] = moshpit.Client(swarm.sockets[VICTIM])
    assert_next_round_complete(clients, alive, ids)


def _refused_beside_a_partner(a: moshpit.Client, b: moshpit.Client, bad: list[torch.Tensor],
                              key: str, codec: str, match: str) -> None:
    """`a` brings values it must refuse, `b` good ones: `a` gets InvalidRequest, and `b` a
    result whose every element is its own value or the mean with `a`'s good values (the bad
    part never left `a`), finite throughout."""
    good = [torch.full_like(t, 3.0) for t in bad]
    mean = [(torch.ones_like(t, dtype=torch.float64) + 3.0) / 2 for t in bad]  # a's good: 1
    out = run_parallel([lambda: a.average(bad, key=key, timeout=10, codec=codec),
                        lambda: b.average(good, key=key, timeout=10, codec=codec)])
    assert isinstance(out[0], moshpit.InvalidRequest) and re.search(match, str(out[0])), out[0]
    assert isinstance(out[1], list), out[1]
    for got, own, avg, sent in zip(out[1], good, mean, bad, strict=True):
        got64 = got.double()
        assert torch.isfinite(got64).all(), got
        ok = (got64 == own.double()) | ((got64 - avg).abs() <= 1e-3 * avg)
        assert ok.all(), (got, sent)
        nonfinite = ~torch.isfinite(sent.double()) | (sent.double().abs() > 65504.0)
        if codec == "fp16":  # a's bad values never arrived: b keeps its own there
            assert (got64[nonfinite] == 3.0).all(), got
        else:
            assert (got64[~torch.isfinite(sent.double())] == 3.0).all(), got


def test_nan_zero_weights_and_duplicate_keys(swarm_factory: Callable[..., LocalSwarm]) -> None:
    swarm = swarm_factory(2)
    a, b = (moshpit.Client(s) for s in swarm.sockets)
    n = 0
    for bad_value in (float("nan"), float("inf"), float("-inf")):
        for dtype in (torch.float32, torch.float64, torch.float16):
            bad = torch.ones(10, dtype=dtype)
            bad[3] = bad_value
            for codec in ("none", "fp16"):
                n += 1
                _refused_beside_a_partner(a, b, [torch.ones(4), bad], f"nan-{n}", codec,
                                          "tensor 1 contains NaN or Inf")
    alone = torch.ones(10)  # no partner: the round never ran, the request is still refused
    alone[2] = float("nan")
    with pytest.raises(moshpit.InvalidRequest, match="tensor 0 contains NaN or Inf"):
        a.average([alone], key="nan-alone", timeout=1)
    # a group whose weights are all 0 has no mean: every member keeps its own values
    results = run_parallel([lambda c=c, v=v: c.average([torch.full((10,), v)], key="zero",
                                                       weight=0.0, timeout=10)
                            for c, v in ((a, 1.0), (b, 2.0))])
    for r, v, c in zip(results, (1.0, 2.0), (a, b), strict=True):
        assert isinstance(r, list) and torch.equal(r[0], torch.full((10,), v)), r
        assert c.last_round is not None and c.last_round.group_size == 2
        assert c.last_round.spans == ((0, 10, 0),) and not c.last_round.fully_averaged
    assert [r["result"] for r in a.rounds()][-1] == "skipped"
    c2 = moshpit.Client(swarm.sockets[0])

    def second_while_the_first_matchmakes() -> object:
        wait_until(lambda: "dup" in active_keys(c2), 3, "the first request matchmaking")
        return c2.average([torch.ones(10)], key="dup", timeout=3)

    first = run_parallel([lambda: a.average([torch.ones(10)], key="dup", timeout=3),
                          second_while_the_first_matchmakes])
    assert isinstance(first[1], moshpit.DuplicateRequest), first


def test_fp16_range_is_checked_before_sending(swarm_factory: Callable[..., LocalSwarm]
                                               ) -> None:
    """fp16 would send 70000 as Inf and every reducer would exclude this honest peer as bad
    data: the values are refused before they are sent, naming the codec and the way out."""
    swarm = swarm_factory(2)
    a, b = (moshpit.Client(s) for s in swarm.sockets)
    for i, big in enumerate((70000.0, -1e6)):
        for dtype in (torch.float32, torch.float64):
            x = torch.ones(300_000, dtype=dtype)
            x[-5] = big
            _refused_beside_a_partner(a, b, [torch.ones(3), x], f"big-{i}-{dtype}", "fp16",
                                      r"tensor 1 .*codec fp16.*bf16")
    x = torch.zeros(10)
    x[1] = 1e5
    with pytest.raises(moshpit.InvalidRequest, match=r"tensor 0 .*codec fp16.*bf16"):
        a.average([x], key="big-alone", codec="fp16", timeout=1)
    edge = [torch.full((1000,), 65504.0), torch.full((10,), -65504.0, dtype=torch.float64)]
    out = run_parallel([lambda c=c: c.average(edge, key="edge", codec="fp16", timeout=10)
                        for c in (a, b)])
    for r in out:
        assert isinstance(r, list), r
        assert torch.equal(r[0], edge[0]) and torch.equal(r[1], edge[1]), r
    x = torch.zeros(1000)
    x[7] = 70000.0
    out = run_parallel([lambda: a.average([x], key="bf16", codec="bf16", timeout=10),
                        lambda: b.average([torch.zeros(1000)], key="bf16", codec="bf16",
                                          timeout=10)])
    for r in out:
        assert isinstance(r, list), r
        assert abs(r[0][7].item() - 35000.0) <= 35000.0 * 2 ** -7 and r[0].isfinite().all(), r
