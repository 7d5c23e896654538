"""Robust aggregation of one part: what a reducer computes instead of the weighted mean when a
run asks for it, over the stacked contributions of the part (one row per sender).

- `trimmed_mean`: per coordinate, drop the lowest and highest `trim` share of the *weight* and
  take the weighted mean of the rest (fractional weights at the cuts, so any weights work).
  Bad peers holding at most `trim` of the weight cannot push a coordinate outside the range of
  the honest values there.
- `centered_clip` (Karimireddy, He, Jaggi, ICML 2021, "Learning from History for Byzantine
  Robust Optimization"): start at the coordinate-wise weighted median v0 and iterate
      v <- v + (1/W) sum_i w_i clip(x_i - v, tau),   clip(z, tau) = z * min(1, tau / ||z||).

The bound behind centered_clip. Let bad rows hold a share d < 1/2 of the weight, the honest rows
lie within rho of their weighted mean m, and e = ||v - m||. One iteration gives
      e' <= max(d (e + tau),  e + (1 - d) rho - (1 - 2d) tau)
(honest rows within tau of v are not clipped and average to m; a clipped honest row moves v by
at most rho + e - tau less than its full pull; a bad row moves v by at most its share of tau).
So when tau >= rho (1 - d) / (1 - 2d) (1.5 rho for d = 1/4), e never grows past
max(e0, d tau / (1 - d)) and falls to d tau / (1 - d) whatever the bad rows hold. Locally the
iteration is a contraction whose rate is the weight share of the clipped rows (< 1/2).

The reducers only see their own parts (spans of the flat vector), so clipping is per part: the
norm in clip() is a part's norm and tau a per-part radius, as in sharded robust aggregation
(BTARD, Gorbunov et al. 2022). tau defaults to TAU_SCALE x the weighted median distance of the
rows from v0. A fixed tau would have to match the scale of every tensor at every stage of
training; this one follows the honest spread. While honest rows hold most of the weight the
median distance is at most an honest row's distance, so bad rows cannot inflate tau; twice the
typical honest distance meets the condition above when honest distances are alike (as they are
for parts of many elements), and a bad row still moves the result by at most d tau / (1 - d).

Everything runs in float64 over the whole stack at once (numpy sorts and BLAS matrix-vector
products; loops run over the k senders only). `aggregate` drops zero-weight rows and caps every
weight at the median weight first: weights are self-reported, so one peer must not buy itself
a majority by claiming a large one.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from moshpitd.ipc.schema import AGGREGATIONS  # the names a request may ask for

TRIM = 0.25  # share of the weight dropped at each end: the mean of the middle half
TAU_SCALE = 2.0  # tau = TAU_SCALE x the weighted median distance from the median
ITERATIONS = 10  # at a clipped share <= 1/4, 10 iterations shrink the start's error 1e6-fold
# ... or fewer: stop once an iteration moves v by at most TOLERANCE * tau (at a contraction
# rate below 1/2, v is then within that distance of the fixed point)
TOLERANCE = 1e-6


class AggregationError(ValueError):
    """An unknown aggregation name, or contributions it cannot aggregate."""


def check_aggregation(name: str) -> str:
    if name not in AGGREGATIONS:
        raise AggregationError(f"aggregation {name!r} is not one of {', '.join(AGGREGATIONS)}")
    return name


def _equal(w: np.ndarray) -> bool:
    return bool(w.size == 0 or (w == w[0]).all())


NETWORK_ROWS = 8  # up to this many rows a sorting network beats np.sort along the short axis


@lru_cache
def _comparators(k: int) -> tuple[tuple[int, int], ...]:
    """Batcher's odd-even merge sort for k items (padded to a power of two with +inf, so the
    comparators touching the padding are no-ops and dropped)."""
    size = 1 << max(k - 1, 0).bit_length()
    pairs = []
    block = 1
    while block < size:
        step = block
        while step >= 1:
            for j in range(step % block, size - step, 2 * step):
                for i in range(min(step, size - j - step)):
                    a, b = i + j, i + j + step
                    if a // (2 * block) == b // (2 * block) and b < k:
                        pairs.append((a, b))
            step //= 2
        block *= 2
    return tuple(pairs)


def sort_rows(x: np.ndarray) -> list[np.ndarray]:
    """The rows of x sorted per column (row 0 the smallest), as separate arrays: a sorting
    network of vectorised min/max for few rows (~3x faster than np.sort for 4), else np.sort."""
    k = x.shape[0]
    if k > NETWORK_ROWS:
        return list(np.sort(x, axis=0))
    rows = [np.array(row, dtype=np.float64) for row in x]
    spare = np.empty(x.shape[1])
    for a, b in _comparators(k):
        np.minimum(rows[a], rows[b], out=spare)
        np.maximum(rows[a], rows[b], out=rows[b])
        rows[a], spare = spare, rows[a]
    return rows


def _sorted(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each column of x sorted, and the weights of its rows in the same order."""
    order = np.argsort(x, axis=0)
    return np.take_along_axis(x, order, axis=0), w[order]


def weighted_median(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Per column of x (k rows), the midpoint of the lower and upper weighted medians: the
    plain median when the weights are equal."""
    k = x.shape[0]
    if _equal(w):  # np.median's partition is ~3x slower than sorting the short axis
        s = sort_rows(x)
        return np.asarray((s[(k - 1) // 2] + s[k // 2]) / 2)
    xs, ws = _sorted(x, w)
    half = float(w.sum()) / 2
    cum = np.zeros(x.shape[1])
    lower = np.zeros(x.shape[1], dtype=np.intp)  # rows before the first with cum >= W/2
    upper = np.zeros(x.shape[1], dtype=np.intp)  # rows before the first with cum > W/2
    for row in ws:  # a loop over the k senders, each step vectorised over the columns
        cum += row
        lower += cum < half
        upper += cum <= half
    lo = np.take_along_axis(xs, np.minimum(lower, k - 1)[None], axis=0)[0]
    hi = np.take_along_axis(xs, np.minimum(upper, k - 1)[None], axis=0)[0]
    return np.asarray((lo + hi) / 2)


def trimmed_mean(x: np.ndarray, w: np.ndarray, trim: float = TRIM) -> np.ndarray:
    """Per column: sort, keep the weight in [trim W, (1 - trim) W] of the sorted order, and
    average what is kept (a row straddling a cut keeps the part of its weight inside)."""
    if not 0 <= trim < 0.5:
        raise AggregationError(f"trim must be in [0, 0.5), not {trim}")
    x = np.asarray(x, dtype=np.float64)
    total = float(w.sum())
    lo, hi = trim * total, (1 - trim) * total
    if _equal(w):  # one set of kept weights for every column
        cum = np.arange(1, w.size + 1) * float(w[0])
        kept = np.clip(np.minimum(cum, hi) - np.maximum(cum - float(w[0]), lo), 0, None)
        acc = np.zeros(x.shape[1])
        for share, row in zip(kept, sort_rows(x), strict=True):  # over the k senders
            if share > 0:
                acc += share * row
        return np.asarray(acc / kept.sum())
    xs, ws = _sorted(x, w)
    num, den, before = np.zeros(x.shape[1]), np.zeros(x.shape[1]), np.zeros(x.shape[1])
    for values, weights in zip(xs, ws, strict=True):  # over the k senders, vectorised
        after = before + weights
        kept = np.clip(np.minimum(after, hi) - np.maximum(before, lo), 0, None)
        num += kept * values
        den += kept
        before = after
    return np.asarray(num / den)


def centered_clip(x: np.ndarray, w: np.ndarray, tau: float | None = None,
                  iterations: int = ITERATIONS, tolerance: float = TOLERANCE,
                  overwrite: bool = False) -> np.ndarray:
    """Centered clipping from the weighted coordinate-wise median (see the module docstring);
    `tau=None` picks TAU_SCALE x the weighted median distance from that start. `overwrite`
    lets it reuse x (float64, C-contiguous) as scratch instead of copying it."""
    x = np.array(x, dtype=np.float64, copy=not overwrite, order="C")
    w = np.asarray(w, dtype=np.float64)
    start = weighted_median(x, w)
    x -= start  # centred rows: distances stay accurate however large the values are
    sq = np.einsum("ij,ij->i", x, x)
    if tau is None:
        tau = TAU_SCALE * float(weighted_median(np.sqrt(sq)[:, None], w)[0])
    if tau < 0:
        raise AggregationError(f"tau must be >= 0, not {tau}")
    if not np.isfinite(tau) or not np.isfinite(sq).all():
        return start  # distances beyond float64 (values near 1e154 or more): the median
    share = w / w.sum()
    u = np.zeros(x.shape[1])
    for _ in range(iterations):
        # ||x_i - u||^2 = ||x_i||^2 - 2 x_i.u + ||u||^2: two passes over x per iteration
        dist = np.sqrt(np.maximum(sq - 2 * (x @ u) + float(u @ u), 0.0))
        far = dist > tau
        scale = np.where(far, tau / np.where(far, dist, 1.0), 1.0)
        s = share * scale
        moved = s @ x + (1.0 - float(s.sum())) * u
        step = float(np.linalg.norm(moved - u))
        u = moved
        if step <= tolerance * tau:
            break
    return np.asarray(start + u)


def cap_weights(w: np.ndarray) -> np.ndarray:
    """Every weight capped at the median weight (of the positive ones)."""
    positive = w[w > 0]
    if positive.size == 0:
        return w
    return np.minimum(w, float(np.median(positive)))


def aggregate(name: str, x: np.ndarray, w: np.ndarray, overwrite: bool = False) -> np.ndarray:
    """The robust aggregate of rows x (float64) weighted by w: zero-weight rows dropped, weights
    capped at their median. `overwrite` lets it use x as scratch."""
    w = np.asarray(w, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] != w.size:
        raise AggregationError(f"{x.shape[0] if x.ndim == 2 else '?'} rows for {w.size} weights")
    keep = w > 0
    if not keep.any():
        raise AggregationError("no contribution has a positive weight")
    if not keep.all():
        x, w, overwrite = x[keep], w[keep], True
    w = cap_weights(w)
    if name == "trimmed_mean":
        out = trimmed_mean(x, w)
    elif name == "centered_clip":
        out = centered_clip(x, w, overwrite=overwrite)
    elif name == "mean":
        out = (w @ x) / w.sum()
    else:
        check_aggregation(name)
        raise AssertionError(name)
    return out
