"""One clock per round: every deadline of a request's round from its timeout and the learnt
link rate (docs/architecture.md, "Deadline model").

The request's timeout bounds everything. Matchmaking gets at most one attempt of
`attempt_max` (the option matchmaking_attempt_timeout) within it. Once the group is assembled,
the round's budget is the policy's: `factor` times what a healthy round of this size takes at the
learnt rate, never below `floor`. The other deadlines are shares of that budget, chosen so that
at the floor (2 s) they are the values the protocol was tuned with: start wait 0.25 s, stall
window 1 s, grace 0.5 s. A bigger round on a slower link gets proportionally more of each.
"""

from __future__ import annotations

import time

from moshpitd.allreduce.deadlines import DeadlinePolicy, RoundDeadlines

START_SHARE = 1 / 8  # of the budget: how long members wait for every owner's READY
STALL_SHARE = 1 / 2  # of the budget: the stall window past the deadline
GRACE_SHARE = 1 / 4  # of the budget: owners' results after our deadline and hard stop
MIN_ROUND = 0.05  # s: a round that starts this close to the request's end still gets this
STREAM_WAIT_ATTEMPTS = 2  # a stream for a group we have not learnt of waits this many attempts


class RoundClock:
    """The deadlines of one request's round, handed out as the round goes."""

    def __init__(self, timeout: float, attempt_max: float, policy: DeadlinePolicy,
                 now: float | None = None) -> None:
        self.start = time.monotonic() if now is None else now
        self.final = self.start + timeout
        self.attempt_max = attempt_max
        self.policy = policy

    def remaining(self, now: float | None = None) -> float:
        return self.final - (time.monotonic() if now is None else now)

    def attempt(self, now: float | None = None) -> float:
        """Seconds for one matchmaking attempt: the setting's bound, within the request."""
        return max(min(self.attempt_max, self.remaining(now)), 0.0)

    def allreduce(self, wire_bytes: int, now: float | None = None) -> RoundDeadlines:
        """The butterfly round's deadlines, for a round that moves `wire_bytes` (sent plus
        received, encoded: RoundPlan.wire_bytes) and starts now. A member still sending past
        the deadline gets one more budget, no more, and never past the request's end."""
        now = time.monotonic() if now is None else now
        budget = self.policy.budget(wire_bytes)
        grace = GRACE_SHARE * budget
        deadline = now + max(min(budget, self.final - now - grace), MIN_ROUND)
        hard = max(min(self.final - grace, deadline + budget), deadline)
        return RoundDeadlines(budget, deadline, grace, hard, now + START_SHARE * budget,
                              STALL_SHARE * budget)

    def learn(self, wire_bytes: int, seconds: float) -> None:
        """A round that averaged everything teaches the rate (same unit as `allreduce`)."""
        self.policy.observe(wire_bytes, seconds)


def stream_wait(attempt_max: float) -> float:
    """How long the data plane holds a stream that names a group we have not learnt of yet:
    every member learns of its group within a matchmaking attempt of the others."""
    return STREAM_WAIT_ATTEMPTS * attempt_max
