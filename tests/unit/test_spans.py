"""The optimal-span rule (allreduce/spans.py) against brute force on small groups, the rates it
is fed (allreduce/rates.py), and the part size those rates set (allreduce/plan.py)."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from moshpitd.allreduce.deadlines import DeadlinePolicy
from moshpitd.allreduce.group import Group, GroupMember
from moshpitd.allreduce.plan import MIN_PART_BYTES, PART_SECONDS, paced_part_bytes
from moshpitd.allreduce.rates import link_rates
from moshpitd.allreduce.spans import optimal_shares, round_time
from moshpitd.transport.stats import Stats

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


def test_slack_fills_the_fastest_first_not_a_slow_member_that_measured_a_little_faster() -> None:
    """Two slow hosts measured at 3.5 and 2.5: the slowest sets T* alone, and the other slow one
    could take a share within T*. The fast hosts can take the whole vector sooner, so it gets
    none: a measurement 40 % too high cannot make it the bottleneck."""
    rates, everyone = [25.0, 25.0, 3.5, 2.5], [True] * 4
    shares = optimal_shares(rates, rates, everyone, everyone)
    assert shares == pytest.approx([0.5, 0.5, 0.0, 0.0])
    times = [(1 + 2 * s) / r for s, r in zip(shares, rates, strict=True)]  # n = m = 4
    assert max(times[:3]) < 0.75 * times[3]  # everyone else is done well before the slowest
    # with no cap, the fast ones fill to a common level and the slow ones stay empty
    shares = optimal_shares(rates, [25.0, 25.0, 25.0, 2.5], everyone, everyone, cap=100.0)
    assert shares[3] == 0.0 and shares[0] == pytest.approx(shares[1])


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


def test_link_rates_add_concurrent_connections_and_skip_small_ones() -> None:
    mib = 1 << 20
    channels = [Stats(4 * mib, 2 * mib, 1.0, 3.0, 1.0, 2.0),  # 2 MiB/s in, 2 out
                Stats(2 * mib, 8 * mib, 1.0, 2.0, 1.0, 5.0),  # 2 MiB/s in, 2 out
                Stats(1024, 1024, 1.0, 1.001, 1.0, 1.001)]  # latency: no rate
    assert link_rates(channels) == (4 * mib, 4 * mib)
    assert link_rates([]) == (0.0, 0.0)


def test_the_first_measurement_replaces_the_prior_then_rates_are_averaged() -> None:
    policy = DeadlinePolicy()
    before = policy.link_mbit
    policy.observe(8 << 20, 1.0, (0.0, 0.0))  # nothing timed: the prior stays
    assert policy.link_mbit == before and not policy.measured
    policy.observe(8 << 20, 1.0, (2.5e6, 5e6))
    assert policy.link_mbit == pytest.approx(20.0)  # the slower way, in Mbit/s
    policy.observe(8 << 20, 1.0, (5e6, 5e6))
    assert 20.0 < policy.link_mbit < 40.0
    policy.observe(1024, 1.0, (1e9, 1e9))  # a small round teaches nothing
    assert policy.link_mbit < 40.0


def test_a_round_cut_short_teaches_the_link_rates_and_a_longer_budget() -> None:
    """Equal spans overran a slow link's budget, so a member was cut: each connection's own
    timing is still sound, and the round's bytes per second bound the throughput from above
    (else spans never follow the links, the budget never grows, and every round is cut)."""
    policy = DeadlinePolicy()
    budget = policy.budget(24_000_000)
    policy.observe(24_000_000, 4.5, (2.5e6, 2.5e6), complete=False)
    assert policy.measured and policy.link_mbit == pytest.approx(20.0)
    assert policy.budget(24_000_000) > budget
    slow = policy.throughput
    policy.observe(24_000_000, 0.01, (2.5e6, 2.5e6), complete=False)  # fast, yet cut: no news
    assert policy.throughput == slow
    policy.observe(24_000_000, 0.5, (2.5e6, 2.5e6))  # a whole round teaches either way
    assert policy.throughput > slow


def test_parts_are_cut_to_the_slowest_declared_link() -> None:
    """A 20 Mbit/s member in a group of 4 shares 2.5 MB/s over 3 connections: a 1 MiB part
    would take 1.3 s, and every reducer waits for whole parts, so parts shrink to the floor;
    fast groups, rates that say nothing and lone members keep the request's size."""
    def group(*rates: float) -> Group:
        return Group(b"g" * 16, "k", 0, b"",
                     tuple(GroupMember(bytes([i]), str(i), 1.0, bandwidth=r)
                           for i, r in enumerate(rates)))

    mib = 1 << 20
    assert paced_part_bytes(group(200, 200, 20, 20), mib) == MIN_PART_BYTES
    assert paced_part_bytes(group(1e4, 1e4, 1e4), mib) == mib
    # 100 Mbit/s over 3 connections: 12.5e6 * PART_SECONDS / 3 bytes
    assert paced_part_bytes(group(100, 100, 100, 100), mib) == int(12.5e6 * PART_SECONDS / 3)
    assert paced_part_bytes(group(math.nan, 0.0), mib) == mib
    assert paced_part_bytes(group(1.0), mib) == mib
    assert paced_part_bytes(group(1e-9, 100), 32 << 10) == 32 << 10  # never above the request
