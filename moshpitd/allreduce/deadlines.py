"""The deadlines of one all-reduce, and the rate they are learnt from.

Every deadline of a round comes from one budget: the time a healthy round of this size takes at
the learnt rate, times a safety factor. The clock (moshpitd/clock.py) derives the rest from it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DeadlinePolicy:
    """A healthy round moves `wire bytes` (sent plus received, in the codec's encoding: see
    RoundPlan.wire_bytes) at `throughput`; faults are declared at `factor` times that, never
    below `floor` seconds. The rate is learnt, in the same unit, from finished rounds."""

    floor: float = 2.0
    factor: float = 4.0
    throughput: float = 100e6  # wire bytes/s sent plus received per peer
    alpha: float = 0.3
    min_learn_bytes: int = 1 << 20  # smaller rounds are mostly latency: they teach no rate

    # what our own link sends and receives at, bytes/s, learnt from the same rounds by each
    # connection's timing (allreduce/rates.py). Until a round measured them: the budget's
    # starting rate, half each way, which every new daemon declares alike (equal spans);
    # the first measurement replaces it, so spans follow the links from the next round on.
    up: float = 50e6
    down: float = 50e6
    measured: bool = False

    def budget(self, wire_bytes: int) -> float:
        return max(self.floor, self.factor * wire_bytes / self.throughput)

    def observe(self, wire_bytes: int, seconds: float,
                rates: tuple[float, float] = (0.0, 0.0), complete: bool = True) -> None:
        """A round cut short still teaches: its connections' rates are sound (each times only
        the bytes it moved), and its bytes per second are an upper bound on the throughput
        (a whole round would have taken longer still), so the learnt one drops to them at
        once, and only whole rounds raise it again. Otherwise a round cut because equal spans
        overran a slow link's budget teaches nothing: spans never follow the links, the budget
        never grows, and every round is cut alike."""
        if seconds > 0 and wire_bytes > self.min_learn_bytes:
            rate = wire_bytes / seconds
            if complete:
                self.throughput = (1 - self.alpha) * self.throughput + self.alpha * rate
            else:  # the bound holds now: the next round's budget must not repeat the cut
                self.throughput = min(self.throughput, rate)
            up, down = rates
            if up > 0 and down > 0:
                keep = (1 - self.alpha) if self.measured else 0.0
                self.up = keep * self.up + (1 - keep) * up
                self.down = keep * self.down + (1 - keep) * down
                self.measured = True

    @property
    def link_mbit(self) -> float:
        """The rate we declare to groups (the option bandwidth's unit): a member's share
        costs it as many bytes each way (allreduce/spans.py), so the slower direction."""
        return min(self.up, self.down) * 8 / 1e6


@dataclass(frozen=True)
class RoundDeadlines:
    """What one butterfly round is told (monotonic times, except the windows)."""

    budget: float  # seconds a round of this size may take before faults are declared
    deadline: float  # when a healthy round should be over: silent senders are excluded then
    grace: float  # after the deadline (and the hard stop), for owners' results to come back
    hard: float  # a member whose bytes still flow is waited for until then, no longer
    start_wait_until: float  # members stream once every owner is READY, or from then on
    stall_window: float  # past the deadline, a peer must show new bytes this often
