"""Which donors a joiner takes its state from: versions vouched for by another peer's record,
headers where holders agree."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from moshpitd.donors import VERSION_SLACK, Donor, agreed, slack, vouched


def donor(i: int, version: int, total: int = 10) -> Donor:
    return Donor(bytes([i]) * 20, f"127.0.0.1:{i + 1}", version, total)


def versions(donors: list[Donor]) -> list[int]:
    return [d.version for d in donors]


def test_one_donor_far_ahead_is_refused_and_the_rest_kept() -> None:
    kept, refused = vouched([donor(0, 41), donor(1, 2**63 - 1), donor(2, 42)])
    assert versions(kept) == [42, 41] and versions(refused) == [2**63 - 1]


def test_versions_near_each_other_are_kept_newest_first() -> None:
    kept, refused = vouched([donor(0, 100), donor(1, 100 + VERSION_SLACK), donor(2, 7)])
    assert versions(kept) == [100 + VERSION_SLACK, 100, 7] and not refused
    now = 1_700_000_000 * 10**9  # clock versions: about 100 s of slack
    kept, refused = vouched([donor(0, now), donor(1, now + 90 * 10**9)])
    assert len(kept) == 2 and not refused
    kept, refused = vouched([donor(0, now), donor(1, now + 3600 * 10**9)])
    assert versions(kept) == [now] and len(refused) == 1


def test_a_refused_record_vouches_for_nothing() -> None:
    """Two identities far apart: the top one is refused first, then the next."""
    kept, refused = vouched([donor(0, 10), donor(1, 10**9), donor(2, 10**18)])
    assert versions(kept) == [10] and versions(refused) == [10**18, 10**9]


def test_two_identities_at_one_version_vouch_for_each_other() -> None:
    """What the rule cannot stop: a key holder with two peer ids."""
    kept, _ = vouched([donor(0, 10), donor(1, 2**62), donor(2, 2**62)])
    assert versions(kept)[0] == 2**62


def test_a_lone_donor_is_kept() -> None:
    assert versions(vouched([donor(0, 2**62)])[0]) == [2**62]
    assert vouched([]) == ([], [])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=8))
def test_kept_versions_each_lie_within_slack_of_the_next(vs: list[int]) -> None:
    kept, refused = vouched([donor(i, v) for i, v in enumerate(vs)])
    assert sorted(versions(kept) + versions(refused)) == sorted(vs) and kept
    top = versions(kept)
    assert top == sorted(top, reverse=True)
    if len(top) >= 2:
        assert top[0] <= top[1] + slack(top[1])
    assert all(r > top[0] for r in versions(refused))


def test_holders_that_send_one_header_are_taken_together() -> None:
    a, b, c = donor(0, 5), donor(1, 5), donor(2, 5)
    assert agreed([(a, {}, b"x"), (b, {}, b"y")]) is None  # states differ: nothing vouched
    same = agreed([(a, {}, b"liar"), (b, {}, b"h"), (c, {}, b"h")])
    assert same is not None and [d for d, _, _ in same] == [b, c]
    assert agreed([(a, {}, b"h"), (donor(1, 5, total=11), {}, b"h")]) is None
