"""Span shares that make a butterfly round's expected time minimal, given the members' rates.

The model. The flat vector has B bytes; member i owns a fraction s_i. `senders` contribute
(weighted members), `owners` may reduce (neither client mode nor a listener). In one round:
- every sender j sends s_i*B to each other owner i (its contribution to span i);
- owner i sends its result, s_i*B, to every other member (n - 1 of them);
- every member receives the others' results, (1 - s_i)*B.
So member i sends  x_i*(1 - s_i)*B + (n - 1)*s_i*B          (x_i = 1 for a sender, else 0)
          receives (m - x_i)*s_i*B + (1 - s_i)*B               (m = the number of senders)
both affine in s_i. Parts stream both ways at once, so member i is busy for
t_i(s_i) = max(sent_i / up_i, received_i / down_i) and the round takes T(s) = max_i t_i(s_i).

The rule. t_i is convex in s_i (a max of affine functions), so the shares that keep member i
within a time T form an interval [lo_i(T), hi_i(T)] of [0, cap_i] (empty when T is too short);
lo_i only falls and hi_i only grows as T grows. Shares summing to 1 with T(s) <= T exist iff
every interval is non-empty and Σ lo_i <= 1 <= Σ hi_i: take s_i = lo_i + λ(hi_i - lo_i) with
the λ in [0, 1] that makes the sum 1. That test is monotone in T, so bisection finds the least
feasible T*: any shares with a smaller makespan T' would make T' feasible, below T*. A
non-owner's time does not depend on the shares (s_i = 0), so it only raises the round's time by
a constant: the rule minimises over the owners' times, which minimises the round's too.

Filling. Any shares within the intervals at T* are optimal, but they differ in what they do
with the slack of members that would be done before T*. Spreading it in proportion to each
member's room hands a slow member that measured a little faster than the slowest one a large
share, right up to T*: rates measured on a real link are a little off, and that member becomes
the bottleneck. So the shares fill up to a common level L <= T* instead: each owner takes the
most that keeps it within L (at least lo_i(T*), at most hi_i(T*)), with the least L whose
shares sum to 1. Every member's time is then as low as the others' allow, so the slack is a
margin for everyone (the least sorted vector of times, for times that grow with the share).

Security. cap_i is SHARE_CAP equal shares (allreduce/layout.py): a member's rates are
self-reported, and t_i grows with s_i and shrinks with its rates: a higher rate fills member i
further at every level and lowers the level the others fill to, so its share only grows with
the rates it declares, and never beyond the cap. Declaring less only lowers it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moshpitd.allreduce.layout import SHARE_CAP

BISECTIONS = 200  # halvings of [0, T_max]: far below a float's resolution, the same everywhere


def round_time(shares: Sequence[float], up: Sequence[float], down: Sequence[float],
               senders: Sequence[bool]) -> float:
    """T(s) of the model above for a vector of 1 byte (times scale with B)."""
    n, m = len(shares), sum(bool(x) for x in senders)
    worst = 0.0
    for s, u, d, snd in zip(shares, up, down, senders, strict=True):
        sent = (1 - s) * snd + (n - 1) * s
        received = (m - snd) * s + (1 - s)
        worst = max(worst, sent / u, received / d)
    return worst


def optimal_shares(up: Sequence[float], down: Sequence[float], senders: Sequence[bool],
                   owners: Sequence[bool], cap: float = SHARE_CAP) -> list[float]:
    """The shares minimising the round time (module docstring), each owner's at most `cap`
    equal shares, non-owners' 0. Rates must be finite and positive (any unit, the same for
    all); at least one owner. Every member computes the same shares from the same rates."""
    n, m = len(up), sum(bool(x) for x in senders)
    if n == 1:
        return [1.0]
    own = np.flatnonzero(np.asarray(owners, dtype=bool))
    if own.size == 0:
        raise ValueError("a group needs at least one owner")
    limit = min(1.0, cap / own.size)
    snd = np.asarray(senders, dtype=np.float64)[own]
    u, d = np.asarray(up, np.float64)[own], np.asarray(down, np.float64)[own]
    # sent = a + b*s, received = c + e*s (per byte of the vector)
    a, b = snd, (n - 1) - snd
    c, e = np.ones(own.size), (m - snd) - 1

    def interval(t: float) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = np.zeros(own.size), np.full(own.size, limit)
        for const, slope, rate in ((a, b, u), (c, e, d)):
            room = t * rate - const  # slope*s must stay within room
            with np.errstate(divide="ignore", invalid="ignore"):
                bound = room / slope
            hi = np.where(slope > 0, np.minimum(hi, bound), hi)
            lo = np.where(slope < 0, np.maximum(lo, bound), lo)
            lo = np.where((slope == 0) & (room < 0), np.inf, lo)  # T too short whatever s
        return lo, hi

    def feasible(t: float) -> bool:
        lo, hi = interval(t)
        return bool((lo <= hi).all() and lo.sum() <= 1.0 <= hi.sum())

    # every share in [0, limit] fits this long: feasible, as limit*owners >= 1
    t_lo, t_hi = 0.0, float(np.max(np.maximum((a + np.abs(b)) / u, (c + np.abs(e)) / d)))
    for _ in range(BISECTIONS):
        mid = (t_lo + t_hi) / 2
        if mid <= t_lo or mid >= t_hi:
            break
        if feasible(mid):
            t_hi = mid
        else:
            t_lo = mid
    lo, hi = interval(t_hi)
    lo, hi = np.minimum(np.maximum(lo, 0.0), limit), np.maximum(np.minimum(hi, limit), 0.0)
    hi = np.maximum(hi, lo)

    def filled(level: float) -> np.ndarray:
        """Each owner's share when it may take as much as keeps it within `level`, kept
        within what T* allows it: shares grow with the level, from lo (0) to hi (T*)."""
        return np.minimum(np.maximum(interval(level)[1], lo), hi)

    # the least level whose filled shares reach 1 (it is at most T*, where they are hi)
    l_lo, l_hi = 0.0, t_hi
    for _ in range(BISECTIONS):
        mid = (l_lo + l_hi) / 2
        if mid <= l_lo or mid >= l_hi:
            break
        if filled(mid).sum() >= 1.0:
            l_hi = mid
        else:
            l_lo = mid
    below, above = filled(l_lo), filled(l_hi)
    spread = above.sum() - below.sum()
    lam = 0.0 if spread <= 0 else min(max((1.0 - below.sum()) / spread, 0.0), 1.0)
    shares = np.zeros(n)
    shares[own] = below + lam * (above - below)
    shares /= shares.sum()
    return [float(x) for x in shares]
