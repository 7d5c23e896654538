"""One clock per round: every deadline of a request's round from its timeout and the learnt
link rate (docs/architecture.md, "Deadline model").

The request's timeout bounds everything. Matchmaking gets at most one attempt of
`attempt_max` (the option matchmaking_attempt_timeout) within it. Once the group is assembled,
the round's budget is the policy's: `factor` times what a healthy round of this size takes at the
learnt rate, never below `floor`. The other deadlines are shares of that budget, chosen so that
at the floor (2 s) they are the values the protocol was tuned with: start wait 0.25 s, stall
window 1 s, grace 0.5 s. A bigger round on a slower link gets proportionally more of each.

Each matchmaking attempt has an `AttemptClock`: its end, and the waits derived from it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from moshpitd import timebase
from moshpitd.allreduce.deadlines import DeadlinePolicy, RoundDeadlines

START_SHARE = 1 / 8  # of the budget: how long members wait for every owner's READY
STALL_SHARE = 1 / 2  # of the budget: the stall window past the deadline
GRACE_SHARE = 1 / 4  # of the budget: owners' results after our deadline and hard stop
MIN_ROUND = 0.05  # s: a round that starts this close to the request's end still gets this
STREAM_WAIT_ATTEMPTS = 2  # a stream for a group we have not learnt of waits this many attempts

# Matchmaking attempts (AttemptClock). These are latencies of one DHT poll or one Join call,
# not transfers: they do not scale with the learnt data-plane rate, so they are constants.
# A group below its target assembles this long before the earliest deadline among its members:
# followers give up at their deadline, and the GroupInfo must reach them first (a DHT poll
# comes between the leader waking up and assembling, then one message on the open Join call).
ASSEMBLY_LEAD = 0.2  # s
ASSEMBLY_LEAD_SHARE = 1 / 10  # of an attempt, at most: a short attempt keeps most of its time
# A leader answers Join (ACCEPTED or a refusal) without I/O of its own, so its first answer
# takes one connection and one round trip: longer means it is gone. Bounded by what is left of
# our attempt, but never shorter than the floor, or a call made at our deadline could not
# succeed even against a live leader.
ANSWER_WAIT = 2.0  # s
MIN_ANSWER_WAIT = 0.2  # s
# An accepted follower waits for the GroupInfo until the later of its own and its leader's
# deadline, plus this: a leader assembles or disbands by its deadline, and this covers its last
# poll (MAX_POLL in the matchmaker) and the message. Beyond it the leader is stuck (say, in a
# cycle of inconsistent views) and must not hold us. The floor gives a follower that was
# accepted at the very end one chance to hear the answer already on its way.
GROUP_INFO_PATIENCE = 1.0  # s
# An accepted follower waits up to this past its leader's declared deadline (not past its own
# plus GROUP_INFO_PATIENCE) for the GroupInfo or a DISBANDED; a leader silent past it is
# shunned. An honest leader disbands at its deadline, late only by a loaded loop's lag.
LEADER_GRACE = 2.0  # s
MIN_GROUP_INFO_WAIT = 0.1  # s


class RoundClock:
    """The deadlines of one request's round, handed out as the round goes."""

    def __init__(self, timeout: float, attempt_max: float, policy: DeadlinePolicy,
                 now: float | None = None) -> None:
        self.start = timebase.monotonic() if now is None else now
        self.final = self.start + timeout
        self.attempt_max = attempt_max
        self.policy = policy

    def remaining(self, now: float | None = None) -> float:
        return self.final - (timebase.monotonic() if now is None else now)

    def attempt(self, now: float | None = None) -> float:
        """Seconds for one matchmaking attempt: the setting's bound, within the request."""
        return max(min(self.attempt_max, self.remaining(now)), 0.0)

    def local_deadline(self) -> float:
        """When a host's local trainers (moshpitd/local/) stop waiting for each other, the
        clock started by the first of them: one matchmaking attempt, as a peer that late would
        miss the swarm's matchmaking anyway, and at most half the request, so the swarm round
        keeps the other half."""
        return self.start + min(self.attempt_max, (self.final - self.start) / 2)

    def allreduce(self, wire_bytes: int, now: float | None = None) -> RoundDeadlines:
        """The butterfly round's deadlines, for a round that moves `wire_bytes` (sent plus
        received, encoded: RoundPlan.wire_bytes) and starts now. A member still sending past
        the deadline gets one more budget, no more, and never past the request's end."""
        now = timebase.monotonic() if now is None else now
        budget = self.policy.budget(wire_bytes)
        grace = GRACE_SHARE * budget
        deadline = now + max(min(budget, self.final - now - grace), MIN_ROUND)
        hard = max(min(self.final - grace, deadline + budget), deadline)
        return RoundDeadlines(budget, deadline, grace, hard, now + START_SHARE * budget,
                              STALL_SHARE * budget)

    def learn(self, wire_bytes: int, seconds: float,
              rates: tuple[float, float] = (0.0, 0.0), complete: bool = True) -> None:
        """A round that averaged everything teaches the rate (same unit as `allreduce`); any
        round teaches our link's send and receive rates (DeadlinePolicy.observe)."""
        self.policy.observe(wire_bytes, seconds, rates, complete)


@dataclass(frozen=True)
class AttemptClock:
    """One matchmaking attempt's deadlines: everything the assembly policy knows of time,
    besides the `now` it is handed. Its end is min(start + attempt, the request's end)."""

    deadline: float  # monotonic: we assemble, follow or give up by then
    seconds: float  # the attempt as requested (MatchRequest.attempt_seconds)

    @classmethod
    def starting(cls, now: float, seconds: float, final: float) -> AttemptClock:
        return cls(min(now + seconds, final), seconds)

    @property
    def start(self) -> float:
        """A full attempt before the deadline (earlier than the real start when the request's
        end cut the attempt short)."""
        return self.deadline - self.seconds

    @property
    def assembly_lead(self) -> float:
        return min(ASSEMBLY_LEAD, self.seconds * ASSEMBLY_LEAD_SHARE)

    def assemble_by(self, member_deadlines: Iterable[float]) -> float:
        """When a group below its target assembles at the latest: before our deadline and
        before every member's (their declarations' TTLs tell, whatever their clocks say)."""
        return min([self.deadline, *member_deadlines]) - self.assembly_lead

    def outlived_by(self, deadline: float, longest: float = 0.0) -> bool:
        """Whether a declaration ending at `deadline` ends more than two attempts after ours
        (`longest`: an uncut attempt, matchmaking_attempt_timeout; our own by default). An
        honest peer declares itself for one attempt, so such a one (dated back to lead, say,
        and signed for ten minutes) would be followed and waited for in vain: a leader that
        accepts and never assembles once held the peers that knew nothing of it, every
        round. A peer whose setting is more than twice ours is taken for it."""
        return deadline > self.deadline + 2 * max(longest, self.seconds)

    def answer_wait(self, now: float) -> float:
        """How long a follower waits for a leader's first answer to Join."""
        return max(min(ANSWER_WAIT, self.deadline - now), MIN_ANSWER_WAIT)

    def group_info_wait(self, now: float, leader_deadline: float = math.inf) -> float:
        """How long an accepted follower waits for its leader's GroupInfo: on its own clock.
        An honest leader assembles before the earliest deadline of its members (ours
        included) and before its own, as its declaration's lifetime tells: nothing it
        declares can make us wait past our own attempt, and a short declaration (one that
        ranks first by its date, say) holds us no longer than it lives."""
        return max(min(self.deadline + GROUP_INFO_PATIENCE, leader_deadline + LEADER_GRACE)
                   - now, MIN_GROUP_INFO_WAIT)


def stream_wait(attempt_max: float) -> float:
    """How long the data plane holds a stream that names a group we have not learnt of yet:
    every member learns of its group within a matchmaking attempt of the others."""
    return STREAM_WAIT_ATTEMPTS * attempt_max
