"""The assembly policy (moshpitd/matchmaking/assembly.py), fed polls at made-up instants: each
rule and its edges, then properties over random sequences of polls. No network, no sleeps."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moshpitd.clock import ASSEMBLY_LEAD, AttemptClock
from moshpitd.matchmaking.assembly import (
    LONELY_POLLS,
    PARTNER_WAIT,
    Action,
    AssemblyPolicy,
    Decision,
    Poll,
)
from moshpitd.matchmaking.request import LineStatus

A, B, C, D = (bytes([i]) * 20 for i in range(1, 5))
ATTEMPT = 5.0
DEADLINE = 105.0  # an attempt that started at t = 100
LEAD = ASSEMBLY_LEAD  # a 5 s attempt's tenth is longer, so the fixed lead applies


def clock(deadline: float = DEADLINE, seconds: float = ATTEMPT) -> AttemptClock:
    return AttemptClock(deadline, seconds)


def policy(target: int = 4, min_size: int = 2, settle: float = 0.5) -> AssemblyPolicy:
    return AssemblyPolicy(target, min_size, settle)


def poll(now: float, members: set[bytes] | frozenset[bytes] = frozenset(),
         declared: dict[bytes, float] | None = None, **kw: object) -> Poll:
    """Members are declared until our deadline unless `declared` says otherwise."""
    if declared is None:
        declared = dict.fromkeys(members, DEADLINE)
    return Poll(now, frozenset(members), declared, **kw)  # type: ignore[arg-type]


def decide(p: AssemblyPolicy, *polls: Poll, at: AttemptClock | None = None) -> list[Decision]:
    return [p.decide(at or clock(), q) for q in polls]


# --- the attempt clock ---------------------------------------------------------------------
def test_attempt_clock_values() -> None:
    c = AttemptClock.starting(100.0, 5.0, final=200.0)
    assert (c.deadline, c.start, c.assembly_lead) == (105.0, 100.0, LEAD)
    cut = AttemptClock.starting(100.0, 5.0, final=102.0)  # the request ends first
    assert cut.deadline == 102.0 and cut.start == 97.0  # a full attempt before its deadline
    assert AttemptClock(10.0, 1.0).assembly_lead == pytest.approx(0.1)  # a tenth, at most
    assert c.assemble_by([]) == 105.0 - LEAD
    assert c.assemble_by([104.0, 106.0]) == 104.0 - LEAD  # the earliest member's deadline
    assert c.answer_wait(100.0) == 2.0  # a leader's first answer: 2 s at most
    assert c.answer_wait(104.5) == pytest.approx(0.5)  # no later than our deadline...
    assert c.answer_wait(106.0) == 0.2  # ...but never too short to be answered at all
    assert c.group_info_wait(100.0) == pytest.approx(6.0)  # our deadline + 1 s, whatever
    assert c.group_info_wait(110.0) == 0.1  # the leader declared: it cannot hold us longer
    # a leader whose declaration ends first holds us no longer than it lives (+ 2 s, for a
    # loaded leader's DISBANDED to come: one silent past that is shunned)...
    assert c.group_info_wait(100.0, leader_deadline=102.0) == pytest.approx(4.0)
    assert c.group_info_wait(100.0, leader_deadline=104.5) == pytest.approx(6.0)
    # ...and one that claims ten minutes no longer than our own attempt
    assert c.group_info_wait(100.0, leader_deadline=700.0) == pytest.approx(6.0)
    # a declaration ending more than two attempts after ours is no honest attempt's...
    assert not c.outlived_by(115.0) and c.outlived_by(115.5) and c.outlived_by(700.0)
    # ...two uncut attempts: a request about to end cuts its own, not its patience
    cut = AttemptClock.starting(100.0, 0.5, final=100.5)
    assert not cut.outlived_by(110.0, longest=5.0) and cut.outlived_by(111.0, longest=5.0)


# --- target size ---------------------------------------------------------------------------
def test_at_target_it_assembles_whatever_else_holds() -> None:
    p = policy(target=3)
    assert p.full(2) and not p.full(1)
    # outsiders declared, an expected peer missing and the list unsettled: target wins
    q = poll(100.0, {A, B}, {A: DEADLINE, B: DEADLINE, C: DEADLINE},
             expected=frozenset({D}), settled=False)
    assert decide(p, q)[0].action is Action.ASSEMBLE


def test_a_peer_that_does_not_lead_never_assembles() -> None:
    """Following someone, or in client mode, a full group is not ours to assemble."""
    p = policy(target=3)
    for now in (100.0, DEADLINE - LEAD, DEADLINE):
        got = decide(p, poll(now, {A, B}, accepting=False, following=True))[0]
        assert got.action is (Action.GIVE_UP if now >= DEADLINE else Action.WAIT)


# --- deadlines -----------------------------------------------------------------------------
def test_below_min_size_it_waits_then_gives_up_at_its_deadline() -> None:
    p = policy(target=8, min_size=3)
    early, late, end = decide(p, poll(100.0, {A}), poll(DEADLINE - LEAD, {A}), poll(DEADLINE, {A}))
    assert early == Decision(Action.WAIT, DEADLINE - LEAD)  # wake for the assembly moment
    assert late == Decision(Action.WAIT, DEADLINE)  # past it, still too small: the deadline
    assert end.action is Action.GIVE_UP


def test_below_target_it_assembles_a_lead_before_the_deadline() -> None:
    p = policy(target=8, min_size=3)
    before, at = decide(p, poll(DEADLINE - LEAD - 1e-3, {A, B}), poll(DEADLINE - LEAD, {A, B}))
    assert before == Decision(Action.WAIT, DEADLINE - LEAD)
    assert at.action is Action.ASSEMBLE  # the moment itself counts


def test_at_the_deadline_a_big_enough_group_assembles_rather_than_gives_up() -> None:
    assert decide(policy(target=8), poll(DEADLINE + 1, {A}))[0].action is Action.ASSEMBLE


def test_the_earliest_member_deadline_sets_the_moment() -> None:
    """A follower gives up at its own deadline (its declaration's TTL tells): the group must
    reach it first, even when the leader's deadline is later."""
    p = policy(target=8)
    declared = {A: 103.0, B: 104.0, C: 101.0}  # C is declared but outside the group
    first = decide(p, poll(100.0, {A, B}, declared))[0]
    assert first == Decision(Action.WAIT, 103.0 - LEAD)  # C's deadline does not count
    assert decide(p, poll(103.0 - LEAD, {A, B}, declared))[0].action is Action.ASSEMBLE


def test_a_member_deadline_equal_to_the_leaders_is_met_too() -> None:
    """Peers that started together share a deadline: the group must still reach them before
    it, so the lead applies (once, not twice)."""
    p = policy(target=8)
    assert decide(p, poll(100.0, {A}, {A: DEADLINE}))[0].wake_at == DEADLINE - LEAD
    assert decide(p, poll(DEADLINE - LEAD, {A}, {A: DEADLINE}))[0].action is Action.ASSEMBLE


def test_same_instant_declarations() -> None:
    """Members declared at the very same instant have the same deadline: one moment, whatever
    the order the DHT returned them in."""
    forward = {A: 104.0, B: 104.0, C: 104.0}
    backward = dict(reversed(forward.items()))
    for declared in (forward, backward):
        p = policy(target=8)
        assert decide(p, poll(100.0, {A, B, C}, declared))[0].wake_at == 104.0 - LEAD
        assert decide(p, poll(104.0 - LEAD, {A, B, C}, declared))[0].action is Action.ASSEMBLE


def test_a_member_not_declared_now_adds_no_deadline() -> None:
    """A follower whose declaration we did not read (withdrawn, or the read missed it)."""
    p = policy(target=8)
    assert decide(p, poll(100.0, {A, B}, {A: 103.0}))[0].wake_at == 103.0 - LEAD


def test_a_short_attempt_keeps_most_of_its_time() -> None:
    short = AttemptClock(101.0, 1.0)  # a 1 s attempt: the lead is a tenth of it
    got = decide(policy(target=8), poll(100.0, {A}, {A: 101.0}), at=short)[0]
    assert got.wake_at == pytest.approx(101.0 - 0.1)


# --- a known line (grid runs) --------------------------------------------------------------
def test_with_expected_peers_it_assembles_once_all_are_in() -> None:
    p = policy(target=8)
    expected = frozenset({A, B})
    waiting = poll(100.0, {A}, {A: DEADLINE, B: DEADLINE}, expected=expected)
    assert decide(p, waiting)[0].action is Action.WAIT
    assert decide(p, poll(100.1, {A, B}, expected=expected))[0].action is Action.ASSEMBLE


def test_an_expected_peer_that_went_elsewhere_is_not_waited_for() -> None:
    p = policy(target=8)
    q = poll(100.0, {A}, expected=frozenset({A, B}), gone=frozenset({B}))
    assert decide(p, q)[0].action is Action.ASSEMBLE


def test_an_unsettled_line_is_waited_for() -> None:
    """Someone joined or left the run lately: the expected list may be incomplete."""
    p = policy(target=8)
    q = poll(100.0, {A, B}, expected=frozenset({A, B}), settled=False)
    assert decide(p, q)[0].action is Action.WAIT
    assert decide(p, poll(DEADLINE - LEAD, {A, B}, expected=frozenset({A, B}),
                          settled=False))[0].action is Action.ASSEMBLE  # but not past the lead


def test_nobody_expected_assembles_at_min_size() -> None:
    p = policy(target=8, min_size=2)
    assert decide(p, poll(100.0, {A}, expected=frozenset()))[0].action is Action.ASSEMBLE
    assert decide(p, poll(100.0, set(), expected=frozenset()))[0].action is Action.WAIT


# --- no known line: the settle clock -------------------------------------------------------
def test_a_complete_group_assembles_after_settling() -> None:
    p = policy(target=8, settle=0.5)
    got = decide(p, poll(100.0, {A, B}), poll(100.4, {A, B}), poll(100.5, {A, B}))
    assert [d.action for d in got] == [Action.WAIT, Action.WAIT, Action.ASSEMBLE]


def test_a_membership_change_restarts_the_settle_clock() -> None:
    p = policy(target=8, settle=0.5)
    got = decide(p, poll(100.0, {A}), poll(100.3, {A, B}), poll(100.6, {A, B}),
                 poll(100.9, {A, B}))
    assert [d.action for d in got] == [Action.WAIT, Action.WAIT, Action.WAIT, Action.ASSEMBLE]


def test_an_outsider_declared_under_the_key_is_waited_for() -> None:
    p = policy(target=8, settle=0.5)
    declared = {A: DEADLINE, B: DEADLINE}
    got = decide(p, poll(100.0, {A}, declared), poll(101.0, {A}, declared))
    assert [d.action for d in got] == [Action.WAIT, Action.WAIT]
    # it is found dead and dropped from the poll: the clock ran all along
    assert decide(p, poll(101.1, {A}, {A: DEADLINE}))[0].action is Action.ASSEMBLE


def test_a_live_partner_of_the_last_group_is_waited_for_a_moment() -> None:
    """Settled, but a partner of our last group that answers has not declared yet: it is
    waited for until PARTNER_WAIT into the attempt (it started at t = 100), and we wake then."""
    p = policy(target=8, settle=0.05)
    late = frozenset({C})
    got = decide(p, poll(100.1, {A}, awaited=late), poll(100.2, {A}, awaited=late))
    assert [d.action for d in got] == [Action.WAIT, Action.WAIT]
    assert got[1].wake_at == 100.0 + PARTNER_WAIT
    assert decide(p, poll(100.0 + PARTNER_WAIT, {A}, awaited=late))[0].action is Action.ASSEMBLE
    # once it is found dead (or it declared and went elsewhere) nobody is awaited
    q = policy(target=8, settle=0.05)
    assert [d.action for d in decide(q, poll(100.1, {A}, awaited=late), poll(100.2, {A}))] == [
        Action.WAIT, Action.ASSEMBLE]


def test_the_settle_clock_survives_attempts() -> None:
    """One policy per matchmaker: a second attempt does not restart the clock."""
    p = policy(target=8, settle=0.5)
    decide(p, poll(100.0, {A}))
    again = poll(105.5, {A}, {A: 110.0})  # long before the new attempt's assembly moment
    assert decide(p, again, at=clock(110.0))[0].action is Action.ASSEMBLE


# --- alone on our line ---------------------------------------------------------------------
LINE = LineStatus(frozenset(), moved_on=False, settled=True, grace=0.2)


def test_alone_on_the_line_for_two_polls_past_the_grace() -> None:
    p = policy()
    start = DEADLINE - ATTEMPT
    assert LONELY_POLLS == 2
    first, second = decide(p, poll(start + 0.2, line=LINE), poll(start + 0.25, line=LINE))
    assert first.action is Action.WAIT  # one empty read proves nothing
    assert second.action is Action.ALONE


def test_alone_within_the_grace_waits() -> None:
    p = policy()
    start = DEADLINE - ATTEMPT
    got = decide(p, poll(start + 0.05, line=LINE), poll(start + 0.1, line=LINE),
                 poll(start + 0.2, line=LINE))
    assert [d.action for d in got] == [Action.WAIT, Action.WAIT, Action.ALONE]


def test_once_the_run_moved_on_half_the_grace_is_enough() -> None:
    moved = LineStatus(frozenset(), moved_on=True, settled=True, grace=0.2)
    start = DEADLINE - ATTEMPT
    got = decide(policy(), poll(start, line=moved), poll(start + 0.15, line=moved))
    assert got[1].action is Action.ALONE
    got = decide(policy(), poll(start, line=LINE), poll(start + 0.15, line=LINE))
    assert got[1].action is Action.WAIT


@pytest.mark.parametrize("company", [
    {"members": {A}},
    {"declared": {A: DEADLINE}},
    {"following": True, "accepting": False},
    {"line": LineStatus(frozenset({A}), moved_on=False)},
    {"line": LineStatus(frozenset(), moved_on=False, settled=False)},
])
def test_not_alone(company: dict[str, object]) -> None:
    """Any follower, declared peer, leader, expected line-mate or unsettled run: not alone."""
    kw: dict[str, object] = {"line": LINE, **company}
    members = kw.pop("members", set())
    p = policy(target=8, min_size=3)
    got = decide(p, *(poll(DEADLINE - 1 + i, members, **kw) for i in range(3)))  # type: ignore[arg-type]
    assert Action.ALONE not in [d.action for d in got]


def test_a_poll_with_company_resets_the_lonely_count() -> None:
    p = policy()
    start = DEADLINE - ATTEMPT
    got = decide(p, poll(start + 1, line=LINE), poll(start + 1.1, {A}, line=LINE),
                 poll(start + 1.2, line=LINE), poll(start + 1.3, line=LINE))
    assert [d.action for d in got][2:] == [Action.WAIT, Action.ALONE]


def test_without_a_line_nobody_is_alone() -> None:
    got = decide(policy(), *(poll(100.0 + i) for i in range(4)))
    assert all(d.action is Action.WAIT for d in got)


# --- properties ----------------------------------------------------------------------------
PEERS = [bytes([i]) * 20 for i in range(1, 7)]
peer_sets = st.frozensets(st.sampled_from(PEERS))


@st.composite
def poll_sequences(draw: st.DrawFn) -> tuple[AssemblyPolicy, AttemptClock, list[Poll]]:
    seconds = draw(st.floats(0.1, 10.0))
    at = AttemptClock(100.0 + seconds, seconds)
    p = AssemblyPolicy(draw(st.integers(1, 7)), draw(st.integers(1, 7)), draw(st.floats(0, 2)))
    now = 100.0
    polls = []
    for _ in range(draw(st.integers(1, 8))):
        now += draw(st.floats(0.0, seconds / 3))
        members = draw(peer_sets)
        declared = {q: draw(st.floats(100.0, 120.0))
                    for q in draw(peer_sets)}
        accepting = draw(st.booleans())
        line = draw(st.none() | st.builds(LineStatus, peer_sets, st.booleans(), st.booleans(),
                                          st.floats(0.0, 2.0)))
        polls.append(Poll(now, members, declared, accepting, not accepting and draw(st.booleans()),
                          draw(st.none() | peer_sets), draw(st.booleans()), draw(peer_sets),
                          line))
    return p, at, polls


@settings(max_examples=100, deadline=None)
@given(poll_sequences())
def test_every_decision_keeps_the_rules(case: tuple[AssemblyPolicy, AttemptClock, list[Poll]]
                                        ) -> None:
    p, at, polls = case
    for q in polls:
        got = p.decide(at, q)
        size = 1 + len(q.members)
        moment = at.assemble_by(d for m, d in q.declared.items() if m in q.members)
        if got.action is Action.ALONE:
            assert q.line is not None and not q.members and not q.declared
            continue
        if got.action is Action.ASSEMBLE:
            assert q.accepting and (size >= p.target_size or size >= p.min_size)
        if q.accepting and (size >= p.target_size or (size >= p.min_size and q.now >= moment)):
            assert got.action is Action.ASSEMBLE
        if got.action is Action.GIVE_UP:
            assert q.now >= at.deadline
        if got.action is Action.WAIT:  # never asked to wake in the past, or past the deadline
            assert q.now < at.deadline and q.now < got.wake_at <= at.deadline


@settings(max_examples=300, deadline=None)
@given(st.floats(0.5, 10.0), st.dictionaries(st.sampled_from(PEERS), st.floats(-5.0, 15.0),
                                             min_size=1),
       st.lists(st.floats(0.01, 1.0), min_size=1, max_size=50))
def test_polled_by_its_wake_times_a_group_reaches_every_member_in_time(
        seconds: float, offsets: dict[bytes, float], gaps: list[float]) -> None:
    """The adapter polls at its own pace, never later than the wake time it was given: a group
    at its minimum size then assembles a lead before the earliest deadline among its members
    (or ours), never later, whatever the pace."""
    at = AttemptClock(100.0 + seconds, seconds)
    declared = {m: 100.0 + seconds + o for m, o in offsets.items()}
    members = frozenset(declared)
    p = AssemblyPolicy(len(members) + 2, len(members) + 1, settle_seconds=1e9)
    moment = min(at.deadline, *declared.values()) - at.assembly_lead
    now = 100.0
    for gap in gaps * 1000:
        got = p.decide(at, Poll(now, members, declared))
        if got.action is Action.ASSEMBLE:
            assert now == max(moment, 100.0)  # at the moment, or at once if it is past
            return
        assert got.action is Action.WAIT and now < moment
        now = min(now + gap, got.wake_at)
    raise AssertionError("never assembled")


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(PEERS), st.floats(100.0, 120.0)), peer_sets,
       st.floats(100.0, 106.0), st.randoms())
def test_the_order_peers_are_read_in_does_not_matter(declared: dict[bytes, float],
                                                     members: frozenset[bytes], now: float,
                                                     rng: random.Random) -> None:
    items = list(declared.items())
    rng.shuffle(items)
    one, two = policy(target=8), policy(target=8)
    assert one.decide(clock(), Poll(now, members, declared)) == \
        two.decide(clock(), Poll(now, members, dict(items)))
