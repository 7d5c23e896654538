"""Robust aggregation: trimmed mean and centered clipping against their bounds, weights, and the
reducer keeping each sender's contribution until a part is final."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from moshpitd.allreduce import robust
from moshpitd.allreduce.layout import Part, TensorSpec, schema_hash
from moshpitd.allreduce.reducer import PartReducer
from moshpitd.allreduce.robust import (
    AggregationError,
    aggregate,
    centered_clip,
    check_aggregation,
    trimmed_mean,
    weighted_median,
)

ROBUST = ["trimmed_mean", "centered_clip"]
seeds = st.integers(min_value=0, max_value=2**32 - 1)


def cclip_bound(e0: float, rho: float, tau: float, d: float, iterations: int) -> float:
    """The error bound of centered clipping after `iterations` (robust.py's docstring):
    e' <= max(d (e + tau), e + (1 - d) rho - (1 - 2d) tau) from e0, or, when it stopped early
    at a step below 1e-6 tau, d tau / (1 - d) plus that step."""
    e = e0
    for _ in range(iterations):
        e = max(d * (e + tau), e + (1 - d) * rho - (1 - 2 * d) * tau)
    return max(e, d * tau / (1 - d) + 1e-6 * tau)


# --- no outliers ------------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(seed=seeds, k=st.integers(1, 9), m=st.integers(1, 40), name=st.sampled_from(ROBUST),
       equal=st.booleans())
def test_identical_inputs_give_the_input(seed: int, k: int, m: int, name: str,
                                         equal: bool) -> None:
    rng = np.random.default_rng(seed)
    row = (rng.standard_normal(m) * 10.0 ** rng.integers(-6, 7)).astype(np.float32)
    w = np.ones(k) if equal else rng.uniform(0.1, 5.0, k)
    out = aggregate(name, np.tile(row.astype(np.float64), (k, 1)), w)
    assert np.array_equal(out.astype(np.float32), row)


@settings(max_examples=100, deadline=None)
@given(seed=seeds, k=st.integers(2, 9), m=st.integers(1, 40))
def test_unclipped_centered_clip_is_the_weighted_mean(seed: int, k: int, m: int) -> None:
    """With tau beyond every distance nothing is clipped: one step from any start lands on the
    weighted mean, which is then a fixed point."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((k, m))
    w = rng.uniform(0.1, 5.0, k)
    out = centered_clip(x, w, tau=1e3)
    np.testing.assert_allclose(out, np.average(x, axis=0, weights=w), rtol=1e-12, atol=1e-12)


# --- weights ----------------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(seed=seeds, k=st.integers(1, 6), m=st.integers(1, 12))
def test_integer_weights_act_as_repeated_rows(seed: int, k: int, m: int) -> None:
    """Weight 3 counts as three equal rows, for the median, the trimmed mean and the clip."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-4, 5, (k, m)).astype(np.float64) + rng.standard_normal((k, m))
    counts = rng.integers(1, 4, k)
    rep = np.repeat(x, counts, axis=0)
    w, ones = counts.astype(np.float64), np.ones(int(counts.sum()))
    np.testing.assert_allclose(weighted_median(x, w), np.median(rep, axis=0), atol=1e-12)
    np.testing.assert_allclose(trimmed_mean(x, w), trimmed_mean(rep, ones), atol=1e-9)
    np.testing.assert_allclose(centered_clip(x, w), centered_clip(rep, ones), atol=1e-9)
    np.testing.assert_allclose(trimmed_mean(x, w, trim=0.0), np.average(x, axis=0, weights=w),
                               atol=1e-12)


def test_trimmed_mean_of_equal_weights_drops_a_quarter_at_each_end() -> None:
    x = np.array([[0.0], [1.0], [2.0], [3.0], [4.0], [5.0], [6.0], [100.0]])
    assert trimmed_mean(x, np.ones(8))[0] == pytest.approx(np.mean([2, 3, 4, 5]))
    # 4 rows: trim 1 from each end
    assert trimmed_mean(x[4:], np.ones(4))[0] == pytest.approx(5.5)


def test_weights_are_capped_at_the_median_and_zero_weights_dropped() -> None:
    honest = np.ones((5, 100))
    bad = np.full((1, 100), 1e6)
    x = np.vstack([honest, bad])
    w = np.array([1.0, 1, 1, 1, 1, 1e9])  # the bad row claims a huge weight
    for name in ROBUST:
        assert np.abs(aggregate(name, x.copy(), w) - 1.0).max() < 1e6 / 5
    # without the cap its weight would be a majority: the cap leaves it one row of six
    assert aggregate("trimmed_mean", x.copy(), w)[0] == pytest.approx(1.0)
    zero = np.array([1.0, 1, 1, 1, 1, 0.0])
    for name in ROBUST:
        assert np.array_equal(aggregate(name, x.copy(), zero), np.ones(100))
    with pytest.raises(AggregationError):
        aggregate("centered_clip", x, np.zeros(6))


# --- f of n corrupted -------------------------------------------------------------------------
@st.composite
def corrupted(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int, float]:
    """n rows, the last f of them bad (f/n <= 1/4), honest rows near a common centre."""
    seed = draw(seeds)
    n = draw(st.integers(4, 12))
    f = draw(st.integers(1, n // 4))
    m = draw(st.integers(50, 400))
    attack = draw(st.sampled_from(["huge", "flip", "same_side", "random"]))
    rng = np.random.default_rng(seed)
    centre = rng.standard_normal(m) * 3
    x = centre + 0.01 * rng.standard_normal((n, m))
    scale = 10.0 ** draw(st.integers(1, 12))
    if attack == "huge":
        x[n - f:] = centre * scale
    elif attack == "flip":
        x[n - f:] = -scale * x[n - f:]
    elif attack == "same_side":
        x[n - f:] = centre + scale
    else:
        x[n - f:] = rng.standard_normal((f, m)) * scale
    return x, np.ones(n), f, scale


@settings(max_examples=150, deadline=None)
@given(c=corrupted())
def test_trimmed_mean_stays_within_the_honest_range(
        c: tuple[np.ndarray, np.ndarray, int, float]) -> None:
    """Bad weight <= trim: every coordinate lies between the honest minimum and maximum."""
    x, w, f, _ = c
    honest = x[:-f]
    out = aggregate("trimmed_mean", x.copy(), w)
    slack = 1e-12 * np.abs(honest).max()
    assert (out >= honest.min(axis=0) - slack).all() and (out <= honest.max(axis=0) + slack).all()


@settings(max_examples=150, deadline=None)
@given(c=corrupted())
def test_centered_clip_stays_within_its_bound(
        c: tuple[np.ndarray, np.ndarray, int, float]) -> None:
    x, w, f, _scale = c
    n = x.shape[0]
    honest = x[:-f]
    mean = honest.mean(axis=0)
    d = f / n
    rho = float(np.linalg.norm(honest - mean, axis=1).max())
    # the start and the default radius, recomputed with plain numpy
    start = np.median(x, axis=0)
    tau = 2.0 * float(np.median(np.linalg.norm(x - start, axis=1)))
    assume(tau >= rho * (1 - d) / (1 - 2 * d))  # the bound's condition (nearly always holds)
    bound = cclip_bound(float(np.linalg.norm(start - mean)), rho, tau, d, 10)
    out = aggregate("centered_clip", x.copy(), w)
    err = float(np.linalg.norm(out - mean))
    assert err <= bound * (1 + 1e-9) + 1e-9, (err, bound)
    # the bound is a real one here: far below how far the attack moves the plain mean
    assert bound < 0.5 * float(np.linalg.norm(x.mean(axis=0) - mean))


@settings(max_examples=100, deadline=None)
@given(seed=seeds, n=st.integers(3, 10), m=st.integers(10, 200),
       mult=st.floats(1.2, 4.0))
def test_centered_clip_bound_for_any_tau_that_meets_the_condition(
        seed: int, n: int, m: int, mult: float) -> None:
    """One bad row anywhere; tau given explicitly, a multiple of the condition's minimum."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, m))
    x[-1] = rng.standard_normal(m) * 1e4
    honest, d = x[:-1], 1 / n
    mean = honest.mean(axis=0)
    rho = float(np.linalg.norm(honest - mean, axis=1).max())
    tau = mult * rho * (1 - d) / (1 - 2 * d)
    start = np.median(x, axis=0)
    for iterations in (1, 3, 10):
        out = centered_clip(x, np.ones(n), tau=tau, iterations=iterations)
        bound = cclip_bound(float(np.linalg.norm(start - mean)), rho, tau, d, iterations)
        assert float(np.linalg.norm(out - mean)) <= bound * (1 + 1e-9)


# --- the reducer ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ROBUST)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_reducer_keeps_each_contribution_until_final(name: str, dtype: type) -> None:
    rng = np.random.default_rng(1)
    rows = (1 + 0.01 * rng.standard_normal((5, 300))).astype(dtype)
    rows[4] = 1000
    red = PartReducer([Part(0, 0, 0, 300, 0)], {0: np.dtype(dtype)}, 5, aggregation=name)
    staging = np.empty(300, dtype=dtype)  # reused for every sender, like the data plane's
    for sender in (3, 0, 4, 1, 2):
        staging[:] = rows[sender]
        final = red.add(0, sender, 1.0, staging)
        staging[:] = np.nan  # the next frame overwrites it
        assert final == (sender == 2)
    assert red.mask(0) == 0b11111
    got = red.result(0)
    assert got.dtype == np.dtype(dtype) and red.result(0) is got
    want = aggregate(name, rows.astype(np.float64), np.ones(5)).astype(dtype)
    np.testing.assert_array_equal(got, want)
    assert np.abs(got.astype(np.float64) - 1).max() < 0.1  # the 1000s did not get through


def test_reducer_exclusion_aggregates_what_arrived() -> None:
    red = PartReducer([Part(0, 0, 0, 4, 0), Part(1, 0, 4, 8, 0)],
                      {0: np.dtype(np.float32)}, 3, aggregation="centered_clip")
    vals = [np.full(4, v, dtype=np.float32) for v in (1.0, 2.0, 3.0)]
    red.add(0, 0, 1.0, vals[0])
    red.add(0, 1, 1.0, vals[1])
    red.add(1, 0, 1.0, vals[0])
    red.add(1, 2, 1.0, vals[2])  # sender 1's part 1 never comes
    assert red.add(0, 2, 1.0, vals[2])
    assert red.exclude(1) == [1]
    assert red.mask(1) == 0b101
    np.testing.assert_allclose(red.result(1), 2.0)
    np.testing.assert_allclose(red.result(0), 2.0)


def test_reducer_mean_is_unchanged_and_names_are_checked() -> None:
    red = PartReducer([Part(0, 0, 0, 3, 0)], {0: np.dtype(np.float32)}, 2)
    assert red.aggregation == "mean"
    red.add(0, 0, 1.0, np.array([1, 2, 3], dtype=np.float32))
    red.add(0, 1, 3.0, np.array([5, 6, 7], dtype=np.float32))
    np.testing.assert_allclose(red.result(0), [4, 5, 6])
    with pytest.raises(AggregationError, match="median"):
        PartReducer([], {}, 2, aggregation="median")
    assert check_aggregation("centered_clip") == "centered_clip"


def test_schema_hash_separates_aggregations_and_keeps_the_mean_hash() -> None:
    specs = [TensorSpec("float32", (10,), 0)]
    hashes = {schema_hash(specs, "none", a) for a in ("mean", *ROBUST)}
    assert len(hashes) == 3
    assert schema_hash(specs, "none", "mean") == schema_hash(specs, "none")


@pytest.mark.parametrize("network", [True, False])
def test_sort_rows_matches_numpy(network: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sorting network (every size up to 32 rows) and the np.sort fallback."""
    monkeypatch.setattr(robust, "NETWORK_ROWS", 64 if network else 0)
    rng = np.random.default_rng(3)
    for k in range(1, 33):
        x = rng.standard_normal((k, 200))
        x[:, :80] = np.round(x[:, :80])  # ties
        assert np.array_equal(np.stack(robust.sort_rows(x)), np.sort(x, axis=0)), k
