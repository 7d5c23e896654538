"""PartReducer: weighted means against numpy, completion, and rejection of bad contributions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from moshpitd.allreduce.layout import Part
from moshpitd.allreduce.reducer import ArrayPool, PartReducer, ReductionError

DTYPES = [np.float16, np.float32, np.float64]


def _reducer(numel: int = 4, senders: int = 3, dtype: type = np.float32) -> PartReducer:
    return PartReducer([Part(0, 0, 0, numel, 0)], {0: np.dtype(dtype)}, senders)


@st.composite
def contributions(draw: st.DrawFn) -> tuple[type, list[float], list[np.ndarray], list[int]]:
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(min_value=1, max_value=6))
    numel = draw(st.integers(min_value=1, max_value=16))
    weights = draw(
        st.lists(
            st.one_of(st.just(0.0), st.floats(min_value=1e-3, max_value=1e3)),
            min_size=n, max_size=n,
        ).filter(lambda ws: sum(ws) >= 1e-3)
    )
    bound = 1e3 if dtype is np.float16 else 1e6
    elements = st.floats(min_value=-bound, max_value=bound, width=np.dtype(dtype).itemsize * 8)
    xs = [draw(hnp.arrays(dtype, numel, elements=elements)) for _ in range(n)]
    order = draw(st.permutations(range(n)))
    return dtype, weights, xs, order


@settings(max_examples=200, deadline=None)
@given(c=contributions())
def test_weighted_mean_matches_numpy(
    c: tuple[type, list[float], list[np.ndarray], list[int]],
) -> None:
    dtype, weights, xs, order = c
    n, numel = len(xs), xs[0].size
    red = _reducer(numel, n, dtype)
    for k, sender in enumerate(order):
        complete = red.add(0, sender, weights[sender], xs[sender])
        assert complete == (k == n - 1)
        assert red.contributors(0) == k + 1
    got = red.result(0)
    assert got.dtype == np.dtype(dtype)
    assert got.shape == (numel,)
    stack = np.stack([x.astype(np.float64) for x in xs])
    want = np.average(stack, weights=weights, axis=0)
    info = np.finfo(dtype)
    # the cast to dtype rounds to nearest (rtol = eps covers half an ulp); accumulation runs in
    # float32 (float64 for float64 parts), whose recursive-summation error is bounded by
    # about n * eps * sum|w x| / sum w
    acc_eps = float(np.finfo(np.float64 if dtype is np.float64 else np.float32).eps)
    w = np.asarray(weights, dtype=np.float64)[:, None]
    spread = float((np.abs(stack) * w).sum(0).max() / w.sum())
    # products w*x below the accumulator's normal range round to its subnormal spacing: an
    # absolute error per product, magnified by the division by sum w
    acc_tiny = float(np.finfo(np.float64 if dtype is np.float64 else np.float32)
                     .smallest_subnormal)
    atol = (float(info.smallest_subnormal) + 2 * n * acc_eps * spread
            + n * acc_tiny / float(w.sum()))
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=float(info.eps), atol=atol)


def test_simple_weighted_mean() -> None:
    red = _reducer(3, 2, np.float32)
    assert not red.add(0, 0, 1.0, np.array([0, 10, 4], dtype=np.float32))
    assert red.add(0, 1, 3.0, np.array([4, 2, 8], dtype=np.float32))
    np.testing.assert_array_equal(red.result(0), [3, 4, 7])


def test_completion_only_after_all_expected_senders() -> None:
    red = _reducer(2, 3)
    x = np.ones(2, dtype=np.float32)
    with pytest.raises(ReductionError):  # senders are member indices 0..2
        red.add(0, 5, 1.0, x)
    assert red.add(0, 0, 1.0, x) is False
    assert red.add(0, 1, 1.0, x) is False
    assert red.contributors(0) == 2
    assert red.add(0, 2, 1.0, x) is True
    assert red.contributors(0) == 3


def test_duplicate_sender_rejected_and_ignored() -> None:
    red = _reducer(2, 2)
    red.add(0, 0, 1.0, np.array([1, 1], dtype=np.float32))
    with pytest.raises(ReductionError):
        red.add(0, 0, 5.0, np.array([9, 9], dtype=np.float32))
    assert red.contributors(0) == 1
    np.testing.assert_array_equal(red.result(0), [1, 1])  # the duplicate did not count
    assert red.add(0, 1, 1.0, np.array([3, 3], dtype=np.float32))
    np.testing.assert_array_equal(red.result(0), [2, 2])


@pytest.mark.parametrize(
    "values",
    [
        np.zeros(3, dtype=np.float32),
        np.zeros(5, dtype=np.float32),
        np.zeros(0, dtype=np.float32),
        np.zeros((2, 2), dtype=np.float32),
        np.zeros((4, 1), dtype=np.float32),
        np.float32(0.0).reshape(()),
    ],
    ids=["short", "long", "empty", "2d-same-size", "column", "scalar"],
)
def test_wrong_size_rejected(values: np.ndarray) -> None:
    red = _reducer(4, 2)
    with pytest.raises(ReductionError):
        red.add(0, 0, 1.0, values)
    assert red.contributors(0) == 0


def test_unknown_part_rejected() -> None:
    red = _reducer(4, 1)
    with pytest.raises(ReductionError):
        red.add(1, 0, 1.0, np.zeros(4, dtype=np.float32))
    with pytest.raises(ReductionError):
        red.add(-1, 0, 1.0, np.zeros(4, dtype=np.float32))


def test_zero_total_weight_fails_on_result() -> None:
    red = _reducer(2, 2)
    red.add(0, 0, 0.0, np.ones(2, dtype=np.float32))
    assert red.add(0, 1, 0.0, np.ones(2, dtype=np.float32))
    with pytest.raises(ReductionError):
        red.result(0)


def test_result_without_contributions_fails() -> None:
    with pytest.raises(ReductionError):
        _reducer(2, 2).result(0)


def test_reduction_error_is_value_error() -> None:
    assert issubclass(ReductionError, ValueError)


def test_parts_are_independent_and_keep_their_run_dtype() -> None:
    parts = [Part(0, 0, 0, 2, 1), Part(1, 1, 0, 3, 1), Part(2, 1, 3, 4, 1)]
    red = PartReducer(parts, {0: np.dtype(np.float16), 1: np.dtype(np.float64)}, 2)
    assert not red.add(0, 0, 1.0, np.array([1, 2], dtype=np.float16))
    assert not red.add(1, 0, 1.0, np.array([1, 2, 3], dtype=np.float64))
    assert red.contributors(2) == 0
    assert red.add(0, 1, 1.0, np.array([3, 4], dtype=np.float16))
    assert red.contributors(1) == 1
    r0 = red.result(0)
    assert r0.dtype == np.float16
    np.testing.assert_array_equal(r0, [2, 3])
    assert red.add(1, 1, 3.0, np.array([5, 6, 7], dtype=np.float64))
    r1 = red.result(1)
    assert r1.dtype == np.float64
    np.testing.assert_array_equal(r1, [4, 5, 6])
    with pytest.raises(ReductionError):
        red.add(2, 0, 1.0, np.zeros(3, dtype=np.float64))  # part 2 holds one element


def test_float16_accumulates_in_float64() -> None:
    """Sums that overflow float16 (max 65504) still average correctly."""
    red = _reducer(1, 4, np.float16)
    for s in range(4):
        red.add(0, s, 10.0, np.array([60000], dtype=np.float16))
    got = red.result(0)
    assert got.dtype == np.float16
    assert got[0] == np.float16(60000)


def test_exclusion_finalises_and_masks_name_the_contributors() -> None:
    red = _reducer(2, 3)
    red.add(0, 0, 1.0, np.array([1, 1], dtype=np.float32))
    red.add(0, 2, 3.0, np.array([5, 5], dtype=np.float32))
    assert not red.is_final(0)
    assert red.exclude(1) == [0]  # the part was waiting only for sender 1
    assert red.exclude(1) == []
    assert red.mask(0) == 0b101
    np.testing.assert_array_equal(red.result(0), [4, 4])
    with pytest.raises(ReductionError):  # an excluded sender cannot come back
        red.add(0, 1, 1.0, np.array([9, 9], dtype=np.float32))


def test_exclusion_before_any_contribution_leaves_no_average() -> None:
    red = _reducer(2, 2)
    red.exclude(0)
    assert not red.is_final(0)
    red.exclude(1)
    assert red.is_final(0) and red.mask(0) == 0
    with pytest.raises(ReductionError):
        red.result(0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_contribution_rejected(bad: float, dtype: type) -> None:
    red = _reducer(3, 2, dtype)
    with pytest.raises(ReductionError, match="non-finite"):
        red.add(0, 0, 1.0, np.array([1, bad, 3], dtype=dtype))
    assert red.contributors(0) == 0
    big = np.full(300_000, np.finfo(dtype).max, dtype=dtype)  # past one chunk, then bad
    big[-1] = bad
    red = _reducer(big.size, 2, dtype)
    with pytest.raises(ReductionError, match="non-finite"):
        red.add(0, 0, 1.0, big)
    assert red.add(0, 0, 1.0, np.full(big.size, np.finfo(dtype).max, dtype=dtype)) is False


@settings(max_examples=100, deadline=None)
@given(c=contributions(), data=st.data())
def test_pieces_and_result_into_match_whole_arrays(
    c: tuple[type, list[float], list[np.ndarray], list[int]], data: st.DataObject,
) -> None:
    """A part in pieces (tensors with a gap between them) averages like one array, and
    result_into writes what result returns, into pieces of another layout."""
    dtype, weights, xs, order = c
    n, numel = len(xs), xs[0].size
    cuts = sorted(data.draw(st.lists(st.integers(0, numel), max_size=3)))
    how = data.draw(st.sampled_from(["mean", "trimmed_mean"]))
    whole, pieced = (PartReducer([Part(0, 0, 0, numel, 0)], {0: np.dtype(dtype)}, n, how)
                     for _ in range(2))
    for sender in order:
        whole.add(0, sender, weights[sender], xs[sender])
        pieced.add(0, sender, weights[sender], np.split(xs[sender], cuts))
    want = whole.result(0)
    out = np.full(numel, np.nan, dtype=dtype)
    pieced.result_into(0, np.split(out, sorted(data.draw(st.lists(st.integers(0, numel))))))
    np.testing.assert_array_equal(out, want)
    if how == "mean":
        with pytest.raises(ReductionError, match="written out"):
            pieced.result(0)


def test_accumulators_are_reused_not_reallocated() -> None:
    pool = ArrayPool(1 << 20)
    parts = [Part(i, 0, 4 * i, 4 * i + 4, 0) for i in range(3)]
    red = PartReducer(parts, {0: np.dtype(np.float32)}, 1, pool=pool)
    red.add(0, 0, 2.0, np.arange(4, dtype=np.float32))
    first = red._slots[0].acc
    out = np.empty(4, dtype=np.float32)
    red.result_into(0, [out])
    np.testing.assert_array_equal(out, [0, 1, 2, 3])
    assert pool.held == 16
    red.add(1, 0, 1.0, np.ones(4, dtype=np.float32))
    assert np.shares_memory(red._slots[1].acc, first) and pool.held == 0
    red.add(2, 0, 1.0, np.ones(4, dtype=np.float32))  # the pool is empty: a new one
    assert not np.shares_memory(red._slots[2].acc, first)
    np.testing.assert_array_equal(red.result(1), [1, 1, 1, 1])  # kept: nothing goes back
    assert pool.held == 0
    small = ArrayPool(8)  # holds at most 8 bytes: a 16-byte accumulator is dropped
    small.give(np.empty(4, dtype=np.float32))
    assert small.held == 0


def test_pieces_that_do_not_fill_the_part_rejected() -> None:
    red = _reducer(4, 2)
    with pytest.raises(ReductionError):
        red.add(0, 0, 1.0, [np.zeros(2, dtype=np.float32), np.zeros(1, dtype=np.float32)])
    with pytest.raises(ReductionError):
        red.add(0, 0, 1.0, [np.zeros(2, dtype=np.float32), np.zeros((1, 2), dtype=np.float32)])
    assert red.contributors(0) == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("weight", [1.0, 2.5])
def test_seed_accumulates_in_the_trainers_buffer(dtype: type, weight: float) -> None:
    """Our own values are not copied: the buffer piece is the accumulator, the result is
    scaled in place, and the piece never goes to the pool (the trainer owns that memory)."""
    pool = ArrayPool(1 << 20)
    red = PartReducer([Part(0, 0, 0, 4, 0)], {0: np.dtype(dtype)}, 2, pool=pool)
    buf = np.array([1, 2, 3, 4], dtype=dtype)
    assert not red.seed(0, 0, weight, buf)
    assert red._slots[0].acc is buf
    assert red.add(0, 1, 1.0, np.full(4, 10, dtype=dtype))
    red.result_into(0, [buf])
    want = (weight * np.array([1, 2, 3, 4]) + 10) / (weight + 1)
    np.testing.assert_allclose(buf, want, rtol=1e-6)
    assert red.mask(0) == 0b11 and pool.held == 0


def test_settle_leaves_the_mean_of_what_arrived_never_a_sum() -> None:
    red = PartReducer([Part(0, 0, 0, 3, 0), Part(1, 0, 3, 6, 0)],
                      {0: np.dtype(np.float32)}, 3)
    buf = np.array([2, 2, 2, 6, 6, 6], dtype=np.float32)
    red.seed(0, 0, 1.0, buf[:3])
    red.seed(1, 0, 3.0, buf[3:])
    red.add(0, 1, 1.0, np.full(3, 4, dtype=np.float32))  # sender 2 never comes
    red.settle()
    np.testing.assert_array_equal(buf, [3, 3, 3, 6, 6, 6])
    red.settle()  # once only
    np.testing.assert_array_equal(buf, [3, 3, 3, 6, 6, 6])


@pytest.mark.parametrize("case", ["float16", "weight 0", "pieces", "robust"])
def test_seed_falls_back_to_a_copy_where_in_place_cannot_work(case: str) -> None:
    """float16 accumulates wider; weight 0 must leave the local values intact for a round
    without an average; pieces and robust rows need their own memory."""
    dtype = np.float16 if case == "float16" else np.float32
    red = PartReducer([Part(0, 0, 0, 4, 0)], {0: np.dtype(dtype)}, 2,
                      aggregation="trimmed_mean" if case == "robust" else "mean")
    buf = np.array([1, 2, 3, 4], dtype=dtype)
    values = [buf[:2], buf[2:]] if case == "pieces" else buf
    red.seed(0, 0, 0.0 if case == "weight 0" else 1.0, values)
    assert red._slots[0].acc is not None and not np.shares_memory(red._slots[0].acc, buf)
    red.settle()
    np.testing.assert_array_equal(buf, [1, 2, 3, 4])


def test_a_huge_weight_cannot_overflow_a_reducers_sum() -> None:
    """Reducers take weights scaled so that the largest is 1 (RoundPlan): a member's weight of
    1e308 used to make the float32 sum Inf, and the reducer's trainer was told that its own
    values held NaN or Inf."""
    from moshpitd.allreduce.group import Group, GroupMember
    from moshpitd.allreduce.plan import unit_weights

    members = tuple(GroupMember(bytes([i]) * 20, "h:1", w) for i, w in
                    enumerate([1e308, 1e300, 0.0]))
    scaled = [m.weight for m in unit_weights(Group(b"g" * 16, "k", 0, b"", members)).members]
    assert scaled == [1.0, 1e-8, 0.0]
    r = _reducer(numel=4, senders=2)
    x = np.array([3e38, -3e38, 1.0, 2.0], dtype=np.float32)
    y = np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)
    r.add(0, 0, scaled[0], x)
    assert r.add(0, 1, scaled[1], y)
    out = r.result(0)
    assert np.isfinite(out).all()
    want = (x.astype(np.float64) + y * 1e-8) / (1 + 1e-8)  # both weights over 1e308
    np.testing.assert_allclose(out, want, rtol=1e-6)
    unchanged = (GroupMember(b"a" * 20, "h:1", 1.0), GroupMember(b"b" * 20, "h:1", 1.0))
    group = Group(b"g" * 16, "k", 0, b"", unchanged)
    assert unit_weights(group) is group  # equal weights of 1: nothing to scale
