"""The optimal-span rule (allreduce/spans.py) against brute force on small groups."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from moshpitd.allreduce.group import Group, GroupMember
from moshpitd.allreduce.spans import optimal_shares, round_time

GRID = 36  # brute force: every split of the vector in 1/GRID steps


def brute_force(up: list[float], down: list[float], senders: list[bool], owners: list[bool],
                cap: float) -> float:
    """The least round time over every grid split that respects the cap."""
    own = [i for i, o in enumerate(owners) if o]
    limit = min(1.0, cap / len(own))
    best = math.inf
    for steps in itertools.product(range(GRID + 1), repeat=len(own) - 1):
        last = GRID - sum(steps)
        if last < 0:
            continue
        shares = [0.0] * len(up)
        for i, k in zip(own, [*steps, last], strict=True):
            shares[i] = k / GRID
        if max(shares) <= limit + 1e-12:
            best = min(best, round_time(shares, up, down, senders))
    return best


def cases() -> list[tuple[list[float], list[float], list[bool], list[bool]]]:
    rng = random.Random(17)
    out = []
    for _ in range(20):
        n = rng.randint(2, 4)
        up = [rng.choice([1.0, 2.0, 10.0]) * rng.uniform(0.5, 1.5) for _ in range(n)]
        down = [rng.choice([1.0, 2.0, 10.0]) * rng.uniform(0.5, 1.5) for _ in range(n)]
        senders = [rng.random() > 0.2 for _ in range(n)]
        senders[0] = True
        owners = [s and rng.random() > 0.2 for s in senders]
        owners[0] = True
        out.append((up, down, senders, owners))
    return out


@pytest.mark.parametrize("cap", [2.0, 100.0])
def test_no_split_is_faster_than_the_rule(cap: float) -> None:
    for up, down, senders, owners in cases():
        shares = optimal_shares(up, down, senders, owners, cap)
        assert math.isclose(sum(shares), 1.0)
        own = sum(owners)
        assert all(s == 0 for s, o in zip(shares, owners, strict=True) if not o)
        assert max(shares) <= min(1.0, cap / own) * (1 + 1e-9)
        ours = round_time(shares, up, down, senders)
        best = brute_force(up, down, senders, owners, cap)
        assert ours <= best * (1 + 1e-9), (up, down, senders, owners, shares)
        # and the grid comes within its step of the rule: the rule is not merely feasible
        assert best <= ours * (1 + 4 * len(up) / GRID)


def test_slow_members_own_less_and_equal_rates_share_equally() -> None:
    everyone = [True] * 4
    assert optimal_shares([1.0] * 4, [1.0] * 4, everyone, everyone) == pytest.approx([0.25] * 4)
    fast, slow = 200.0, 20.0  # Mbit/s, the netns scenario of docs/architecture.md
    shares = optimal_shares([fast, fast, slow, slow], [fast, fast, slow, slow], everyone,
                            everyone)
    assert shares[2] == shares[3] < 0.1 < shares[0] == pytest.approx(shares[1])
    equal = round_time([0.25] * 4, [fast, fast, slow, slow], [fast, fast, slow, slow],
                       everyone)
    assert round_time(shares, [fast, fast, slow, slow], [fast, fast, slow, slow],
                      everyone) < 0.7 * equal  # the slow ones still send and take B


def test_a_declared_rate_only_raises_its_own_share_up_to_the_cap() -> None:
    everyone = [True] * 4
    previous = 0.0
    for rate in [1e-9, 0.1, 1.0, 3.0, 10.0, 1e6, 1e12]:
        rates = [rate, 1.0, 1.0, 1.0]
        share = optimal_shares(rates, rates, everyone, everyone)[0]
        assert previous <= share <= 0.5 * (1 + 1e-9)
        previous = share
    assert previous == pytest.approx(0.5)


def test_group_shares_leave_listeners_and_client_mode_peers_out() -> None:
    members = (GroupMember(b"a", "a", 1.0, bandwidth=3.0), GroupMember(b"b", "b", 1.0),
               GroupMember(b"c", "c", 1.0, client_mode=True), GroupMember(b"d", "d", 0.0),
               GroupMember(b"e", "e", 1.0, bandwidth=math.nan))
    shares = Group(b"g" * 16, "k", 0, b"", members).shares
    assert shares[2:] == [0.0, 0.0, 0.0]
    assert shares[0] > shares[1] and math.isclose(sum(shares), 1.0)
