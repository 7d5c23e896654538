"""When a leader assembles its group: a pure policy, fed what each poll saw.

The matchmaker does the I/O (DHT reads, probes, Join calls, sleeps) and hands this core one
`Poll` at a time, with the attempt's clock; the core answers what to do next. It reads no
clock and touches no network, so tests feed it polls at made-up instants.

A leader assembles, in this order of precedence:
- at its target size;
- never below its minimum size;
- at the latest `AttemptClock.assemble_by` the earliest deadline among it and its members;
- with a known line (grid runs), once every expected peer is in or went to another group;
- without one, once everyone declared under the key is in and the membership has not changed
  for `settle_seconds`, and no partner of our last group that still answers is missing
  (those are waited for PARTNER_WAIT from the attempt's start at most).
A peer alone on its line for two polls, past a grace period, keeps its value; past its deadline
a peer below its minimum gives up.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from moshpitd.clock import AttemptClock
from moshpitd.matchmaking.request import LineStatus

# Being alone must be seen on this many polls in a row: one empty read of the DHT can be a
# line-mate caught between withdrawing one declaration and storing the next.
LONELY_POLLS = 2
# Once some peer of the run has declared a later round, we are probably the one left behind:
# give up on the round after this share of the grace period (never at once: a line-mate that
# is still starting may not have declared yet).
MOVED_ON_GRACE_SHARE = 1 / 2
# How long into an attempt a leader below its target waits for a live partner of its last group
# that has not declared yet. A peer whose trainer came a few polls late (a busy host) would
# otherwise find every partner gone into a group without it and wait out its whole timeout.
# One round at most: a partner that does not come is no partner the next round.
PARTNER_WAIT = 0.5  # s


class Action(enum.Enum):
    WAIT = "wait"  # follow earlier peers if any, then poll again by `wake_at`
    ASSEMBLE = "assemble"  # send our followers the group
    GIVE_UP = "give_up"  # the attempt is over: release our followers
    ALONE = "alone"  # nobody on our line comes to this round: keep our value


@dataclass(frozen=True)
class Decision:
    action: Action
    wake_at: float = 0.0  # WAIT: poll again by then at the latest (assembly, else deadline)


@dataclass(frozen=True)
class Poll:
    """What one poll saw at `now`."""

    now: float
    members: frozenset[bytes]  # our followers
    # matching peers declared under the key (not found dead) -> their deadline, our clock
    declared: Mapping[bytes, float]
    accepting: bool = True  # we lead: not following anyone, not a client-mode peer
    following: bool = False  # a leader has accepted us
    # line-mates still to come (None without a grid), and whether that list is complete
    expected: frozenset[bytes] | None = None
    settled: bool = True
    # peers that declared under the key earlier and have withdrawn since (they went elsewhere)
    gone: frozenset[bytes] = frozenset()
    line: LineStatus | None = None  # the run directory's view of our line, in grid runs
    # partners of our last group (no grid) neither here nor declared, that answered a probe
    awaited: frozenset[bytes] = frozenset()


class AssemblyPolicy:
    """One matchmaker's decision state: the settle clock (when our membership last changed)
    and how many polls in a row found us alone. Both persist across attempts."""

    def __init__(self, target_size: int, min_size: int, settle_seconds: float) -> None:
        self.target_size = target_size
        self.min_size = min_size
        self.settle_seconds = settle_seconds
        self._stable_members: frozenset[bytes] = frozenset()
        self._stable_since = 0.0
        self._lonely_polls = 0

    def full(self, members: int) -> bool:
        """A group of `members` followers plus us is at its target: assemble without polling."""
        return 1 + members >= self.target_size

    def decide(self, clock: AttemptClock, poll: Poll) -> Decision:
        if poll.line is not None and self._alone(clock, poll, poll.line):
            return Decision(Action.ALONE)
        assemble_at = clock.assemble_by(d for p, d in poll.declared.items() if p in poll.members)
        if poll.accepting and self._ready(poll, assemble_at, clock.start + PARTNER_WAIT):
            return Decision(Action.ASSEMBLE)
        if poll.now >= clock.deadline:
            return Decision(Action.GIVE_UP)
        wake = assemble_at if poll.now < assemble_at else clock.deadline
        if poll.awaited and poll.now < clock.start + PARTNER_WAIT:
            wake = min(wake, clock.start + PARTNER_WAIT)
        return Decision(Action.WAIT, wake)

    def _ready(self, poll: Poll, assemble_at: float, partners_by: float) -> bool:
        size = 1 + len(poll.members)
        if size >= self.target_size:
            return True
        if size < self.min_size:
            return False
        if poll.now >= assemble_at:
            return True
        if poll.expected is not None:
            if not poll.settled:
                return False
            # Every expected peer is with us, or came and left for another group.
            return all(p in poll.members or p in poll.gone for p in poll.expected)
        # Everyone declared under the key is already with us, and nobody new declared for a
        # while: with no target in sight, waiting longer gains nothing.
        # (The clock runs from the last change of our membership, so an outsider found dead
        # costs no extra settle time once it is dropped.)
        if poll.members != self._stable_members:
            self._stable_members, self._stable_since = poll.members, poll.now
            return False
        outside = any(p not in poll.members for p in poll.declared)
        if outside or poll.now - self._stable_since < self.settle_seconds:
            return False
        return not poll.awaited or poll.now >= partners_by

    def _alone(self, clock: AttemptClock, poll: Poll, line: LineStatus) -> bool:
        """Nobody on our line is coming: keep our value instead of waiting for the deadline."""
        alone = (not poll.members and not poll.following and not poll.declared
                 and not line.expected and line.settled)
        self._lonely_polls = self._lonely_polls + 1 if alone else 0
        grace = line.grace * MOVED_ON_GRACE_SHARE if line.moved_on else line.grace
        return alone and self._lonely_polls >= LONELY_POLLS and poll.now - clock.start >= grace
