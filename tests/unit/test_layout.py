"""Flat-vector layout: runs, span bounds, part plans, FlatView, spec validation, schema hash."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from moshpitd.allreduce.layout import (
    SUPPORTED_DTYPES,
    FlatView,
    LayoutError,
    Part,
    Run,
    TensorSpec,
    capped_shares,
    plan_parts,
    runs_of,
    schema_hash,
    span_bounds,
    validate_specs,
)

DTYPES = sorted(SUPPORTED_DTYPES)
ALIGN = 64


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _layout(
    schema: list[tuple[str, tuple[int, ...]]], gap: int = 0
) -> tuple[list[TensorSpec], int]:
    """Specs at 64-byte-aligned offsets, in order, plus the buffer size that holds them."""
    specs, offset = [], 0
    for dtype, shape in schema:
        spec = TensorSpec(dtype, shape, offset)
        specs.append(spec)
        offset = _align(offset + spec.nbytes) + gap * ALIGN
    return specs, max(offset, 1)


shapes = st.lists(st.integers(min_value=0, max_value=7), min_size=0, max_size=3).map(tuple)
schemas = st.lists(st.tuples(st.sampled_from(DTYPES), shapes), min_size=1, max_size=8)
shares_st = st.lists(
    st.one_of(st.just(0.0), st.floats(min_value=1e-3, max_value=1e3)), min_size=1, max_size=6
).filter(lambda s: sum(s) > 0)


# --- span_bounds ------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(total=st.integers(min_value=0, max_value=10**7), shares=shares_st)
def test_span_bounds_properties(total: int, shares: list[float]) -> None:
    bounds = span_bounds(total, shares)
    assert len(bounds) == len(shares) + 1
    assert bounds[0] == 0
    assert bounds[-1] == total
    assert all(a <= b for a, b in itertools.pairwise(bounds))
    whole = sum(shares)
    for i, share in enumerate(shares):
        span = bounds[i + 1] - bounds[i]
        if share == 0:
            assert span == 0
        # each bound is the exact cut rounded to nearest: a span is off by at most one element
        assert abs(span - share / whole * total) <= 1 + 1e-9 * total
    assert span_bounds(total, shares) == bounds  # deterministic


def test_span_bounds_examples() -> None:
    assert span_bounds(10, [1.0]) == [0, 10]
    assert span_bounds(10, [1.0, 1.0]) == [0, 5, 10]
    assert span_bounds(9, [1.0, 2.0]) == [0, 3, 9]
    assert span_bounds(10, [0.0, 1.0, 0.0]) == [0, 0, 10, 10]
    assert span_bounds(0, [1.0, 1.0]) == [0, 0, 0]


@pytest.mark.parametrize("shares", [[], [-1.0, 2.0], [0.0], [0.0, 0.0]])
def test_span_bounds_rejects_bad_shares(shares: list[float]) -> None:
    with pytest.raises(ValueError):
        span_bounds(10, shares)


@pytest.mark.parametrize(
    "shares",
    [[math.nan, 1.0], [1.0, math.nan], [math.inf, 1.0], [1.0, math.inf], [1e308, 1e308]],
    ids=["nan-first", "nan-last", "inf-first", "inf-last", "cumsum-overflow"],
)
def test_span_bounds_non_finite_shares_rejected_or_valid(shares: list[float]) -> None:
    """Shares derive from member bandwidths sent over the network (Group.shares passes NaN/inf
    through max(bw, 1e-9)). Either refuse them or still return valid, proportional bounds."""
    total = 100
    try:
        bounds = span_bounds(total, shares)
    except ValueError:
        return
    assert bounds[0] == 0 and bounds[-1] == total
    assert all(a <= b for a, b in itertools.pairwise(bounds)), bounds
    if all(math.isfinite(s) for s in shares):
        assert bounds == [0, 50, 100]


# --- runs_of ---------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(schema=schemas)
def test_runs_group_consecutive_same_dtype(schema: list[tuple[str, tuple[int, ...]]]) -> None:
    specs, _ = _layout(schema)
    runs = runs_of(specs)
    covered = [i for r in runs for i in r.tensors]
    assert covered == sorted(covered)  # request order
    assert len(set(covered)) == len(covered)
    for r in runs:
        assert r.numel > 0
        assert r.numel == sum(specs[i].numel for i in r.tensors)
        assert list(r.tensors) == list(range(r.tensors[0], r.tensors[-1] + 1))  # consecutive
        assert {specs[i].dtype for i in r.tensors} == {r.dtype}
    # every tensor with elements is in some run; a tensor missing from every run is empty
    for i, s in enumerate(specs):
        if i not in covered:
            assert s.numel == 0
    # a run ends where the dtype changes
    for r in runs:
        nxt = r.tensors[-1] + 1
        if nxt < len(specs) and nxt in covered:
            assert specs[nxt].dtype != r.dtype
    assert runs_of(specs) == runs


def test_runs_example() -> None:
    specs, _ = _layout(
        [("float32", (2,)), ("float32", (3,)), ("float16", (4,)), ("float32", ()),
         ("float64", (0, 5))]
    )
    assert runs_of(specs) == [
        Run("float32", 5, (0, 1)),
        Run("float16", 4, (2,)),
        Run("float32", 1, (3,)),
    ]


# --- plan_parts ------------------------------------------------------------------------------


def _check_plan(runs: list[Run], shares: list[float], part_bytes: int) -> list[Part]:
    parts = plan_parts(runs, shares, part_bytes)
    assert [p.index for p in parts] == list(range(len(parts)))
    total = sum(r.numel for r in runs)
    bounds = span_bounds(total, capped_shares(shares))
    run_starts = np.cumsum([0] + [r.numel for r in runs]).tolist()
    for ri, run in enumerate(runs):
        mine = sorted((p for p in parts if p.run == ri), key=lambda p: p.start)
        # exact tiling of the run: no gap, no overlap
        pos = 0
        for p in mine:
            assert p.start == pos
            assert p.stop > p.start
            pos = p.stop
        assert pos == run.numel
        itemsize = np.dtype(run.dtype).itemsize
        for p in mine:
            assert 0 <= p.start < p.stop <= run.numel  # within one run
            if itemsize <= part_bytes:
                assert p.numel * itemsize <= part_bytes
            else:
                assert p.numel == 1
            # inside the owner's span of the flat vector
            g0, g1 = run_starts[ri] + p.start, run_starts[ri] + p.stop
            assert bounds[p.owner] <= g0 and g1 <= bounds[p.owner + 1]
    for owner, share in enumerate(shares):
        owned = sum(p.numel for p in parts if p.owner == owner)
        assert owned == bounds[owner + 1] - bounds[owner]
        if share == 0:
            assert owned == 0
    assert plan_parts(runs, shares, part_bytes) == parts  # deterministic
    return parts


@settings(max_examples=200, deadline=None)
@given(schema=schemas, shares=shares_st, part_bytes=st.integers(min_value=1, max_value=96))
def test_plan_parts_tiles_runs(
    schema: list[tuple[str, tuple[int, ...]]], shares: list[float], part_bytes: int
) -> None:
    specs, _ = _layout(schema)
    _check_plan(runs_of(specs), shares, part_bytes)


@settings(max_examples=300, deadline=None)
@given(shares=shares_st)
def test_capped_shares_hold_no_more_than_twice_an_equal_share(shares: list[float]) -> None:
    out = capped_shares(shares)
    owners = [s for s in shares if s > 0]
    assert math.isclose(sum(out), 1.0)
    assert all(o <= 2 / len(owners) * (1 + 1e-6) for o in out)
    assert [o > 0 for o in out] == [s > 0 for s in shares]  # nobody gains or loses a span
    # below the cap, the order of the shares is kept
    for a, b, x, y in ((a, b, x, y) for a, x in zip(shares, out, strict=True)
                       for b, y in zip(shares, out, strict=True)):
        assert a > b or x <= y * (1 + 1e-9)


def test_capped_shares_examples() -> None:
    assert capped_shares([1.0, 1.0]) == [0.5, 0.5]
    big, small = capped_shares([1e12, 1.0])  # two owners: the cap (2 x 1/2) is the whole
    assert math.isclose(big, 1.0) and 0 < small < 1e-11
    out = capped_shares([1e12, 1.0, 1.0, 0.0])  # three owners: at most 2/3
    assert out[0] == 2 / 3 and out[3] == 0 and math.isclose(out[1], 1 / 6)
    out = capped_shares([1e6, 1e6, 1.0, 1.0, 1.0, 1.0])  # two capped at 1/3 each
    assert math.isclose(out[0], 1 / 3) and math.isclose(out[1], 1 / 3)
    assert math.isclose(out[2], 1 / 12)


def test_a_huge_bandwidth_reduces_at_most_twice_an_equal_share() -> None:
    runs = [Run("float32", 1200, (0,))]
    parts = plan_parts(runs, [1e12, 1e-9, 1.0, 1.0], 1 << 20)
    owned = [sum(p.numel for p in parts if p.owner == i) for i in range(4)]
    assert owned[0] == 600 and sum(owned) == 1200 and owned[1] < 1


def test_plan_parts_owner_spans_contiguous_in_order() -> None:
    runs = [Run("float32", 1000, (0,))]
    parts = _check_plan(runs, [1.0, 3.0], 400)  # 100 elements per part
    assert [p.owner for p in parts] == [0, 0, 0] + [1] * 8
    assert [(p.start, p.stop) for p in parts[:3]] == [(0, 100), (100, 200), (200, 250)]
    assert max(p.numel for p in parts) == 100


def test_plan_parts_part_smaller_than_item() -> None:
    parts = _check_plan([Run("float64", 5, (0,))], [1.0], 3)
    assert [p.numel for p in parts] == [1] * 5


def test_plan_parts_no_runs() -> None:
    assert plan_parts([], [1.0, 1.0]) == []


def test_plan_parts_cuts_at_run_boundaries() -> None:
    runs = [Run("float32", 3, (0,)), Run("float16", 5, (1,))]
    parts = _check_plan(runs, [1.0], 1 << 20)
    assert [(p.run, p.start, p.stop) for p in parts] == [(0, 0, 3), (1, 0, 5)]


# --- FlatView --------------------------------------------------------------------------------


def _values(dtype: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.uniform(-100, 100, n).astype(dtype)


@settings(max_examples=150, deadline=None)
@given(
    schema=schemas,
    shares=shares_st,
    part_bytes=st.integers(min_value=1, max_value=200),
    gap=st.integers(min_value=0, max_value=1),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_flatview_write_read_round_trip(
    schema: list[tuple[str, tuple[int, ...]]],
    shares: list[float],
    part_bytes: int,
    gap: int,
    seed: int,
) -> None:
    specs, size = _layout(schema, gap)
    raw = bytearray(b"\xab" * size)
    view, raw_arr = FlatView(memoryview(raw), specs), np.frombuffer(raw, np.uint8)
    parts = plan_parts(view.runs, shares, part_bytes)
    # the expected flat vector per run, written part by part
    want = [_values(r.dtype, r.numel, seed + i) for i, r in enumerate(view.runs)]
    for p in parts:
        view.write(p, want[p.run][p.start:p.stop])
    for p in parts:
        got, pieces = view.read(p), view.views(p)
        assert got.dtype == np.dtype(view.runs[p.run].dtype)
        np.testing.assert_array_equal(got, want[p.run][p.start:p.stop])
        np.testing.assert_array_equal(np.concatenate(pieces), got)  # views tile the part
        assert (len(pieces) == 1) == np.shares_memory(got, raw_arr)  # one slice: a view
    # the tensors in the buffer hold the run's values, in order
    for ri, r in enumerate(view.runs):
        flat = np.concatenate(
            [np.frombuffer(raw, dtype=specs[i].dtype, count=specs[i].numel,
                           offset=specs[i].offset) for i in r.tensors]
        )
        np.testing.assert_array_equal(flat, want[ri])
    # bytes outside every tensor are untouched
    touched = np.zeros(size, dtype=bool)
    for s in specs:
        touched[s.offset:s.offset + s.nbytes] = True
    assert all(b == 0xAB for b, t in zip(raw, touched, strict=True) if not t)


def test_flatview_part_across_tensor_boundaries() -> None:
    schema = [("float32", (3,)), ("float32", (2, 2)), ("float32", (5,))]
    specs, size = _layout(schema)
    raw = bytearray(size)
    view = FlatView(memoryview(raw), specs)
    assert len(view.runs) == 1 and view.runs[0].numel == 12
    part = Part(0, 0, 2, 10, 0)  # last of t0, all of t1, first two of t2
    view.write(part, np.arange(8, dtype=np.float32) + 1)
    t = [np.frombuffer(raw, dtype=np.float32, count=s.numel, offset=s.offset) for s in specs]
    np.testing.assert_array_equal(t[0], [0, 0, 1])
    np.testing.assert_array_equal(t[1], [2, 3, 4, 5])
    np.testing.assert_array_equal(t[2], [6, 7, 8, 0, 0])
    np.testing.assert_array_equal(view.read(part), np.arange(8) + 1)


def test_flatview_read_within_one_slice_of_memory_is_a_view() -> None:
    specs, size = _layout([("float64", (8,)), ("float64", (8,)), ("float32", (3,))])
    raw = bytearray(size)
    view = FlatView(memoryview(raw), specs)
    view.read(Part(0, 0, 1, 3, 0))[:] = 7.0
    view.read(Part(1, 0, 7, 9, 0))[:] = 8.0  # t0 and t1 lie back to back: still one slice
    assert np.frombuffer(raw, dtype=np.float64, count=10).tolist() == [0, 7, 7, 0, 0, 0, 0,
                                                                       8, 8, 0]
    gapped, _ = _layout([("float32", (3,)), ("float32", (3,))])  # 12 bytes, then padding
    view = FlatView(memoryview(bytearray(size)), gapped)
    assert [v.size for v in view.views(Part(0, 0, 1, 5, 0))] == [2, 2]


def test_flatview_mixed_dtypes_keep_their_bytes() -> None:
    schema = [("float16", (3,)), ("float64", (2,)), ("float32", (1, 3))]
    specs, size = _layout(schema)
    raw = bytearray(size)
    view = FlatView(memoryview(raw), specs)
    assert [r.dtype for r in view.runs] == ["float16", "float64", "float32"]
    parts = plan_parts(view.runs, [1.0, 1.0], 4)
    for p in parts:
        view.write(p, np.full(p.numel, p.run + 0.5, dtype=view.runs[p.run].dtype))
    assert np.frombuffer(raw, np.float16, 3, 0).tolist() == [0.5] * 3
    assert np.frombuffer(raw, np.float64, 2, specs[1].offset).tolist() == [1.5] * 2
    assert np.frombuffer(raw, np.float32, 3, specs[2].offset).tolist() == [2.5] * 3


def test_flatview_rejects_invalid_specs() -> None:
    with pytest.raises(LayoutError):
        FlatView(memoryview(bytearray(8)), [TensorSpec("float32", (3,), 0)])


# --- validate_specs --------------------------------------------------------------------------


def test_validate_accepts_exact_fit() -> None:
    validate_specs([TensorSpec("float32", (4,), 0), TensorSpec("float16", (2,), 16)], 20)
    validate_specs([TensorSpec("float64", (0,), 8)], 8)  # empty tensor at the very end


@pytest.mark.parametrize(
    ("specs", "size"),
    [
        ([], 64),
        ([TensorSpec("int32", (2,), 0)], 64),
        ([TensorSpec("bfloat16", (2,), 0)], 64),
        ([TensorSpec("float32", (2,), 0), TensorSpec("uint8", (1,), 8)], 64),
        ([TensorSpec("float32", (2,), 2)], 64),
        ([TensorSpec("float64", (1,), 4)], 64),
        ([TensorSpec("float16", (1,), 1)], 64),
        ([TensorSpec("float32", (1,), -4)], 64),
        ([TensorSpec("float32", (17,), 0)], 64),
        ([TensorSpec("float32", (1,), 64)], 64),
        ([TensorSpec("float32", (2,), 0), TensorSpec("float64", (7,), 16)], 64),
        ([TensorSpec("float32", (-1,), 0)], 64),
        ([TensorSpec("float32", (2, -3), 0)], 64),
        ([TensorSpec("float32", (-2, -3), 0)], 64),
    ],
    ids=[
        "empty", "int32", "bfloat16", "uint8-second", "misaligned-f32", "misaligned-f64",
        "misaligned-f16", "negative-offset", "past-end", "starts-at-end", "second-past-end",
        "negative-dim", "negative-second-dim", "two-negative-dims",
    ],
)
def test_validate_rejects(specs: list[TensorSpec], size: int) -> None:
    with pytest.raises(LayoutError):
        validate_specs(specs, size)


@settings(max_examples=100, deadline=None)
@given(schema=schemas)
def test_validate_accepts_aligned_layouts(schema: list[tuple[str, tuple[int, ...]]]) -> None:
    specs, size = _layout(schema)
    validate_specs(specs, size)
    last = max(specs, key=lambda s: s.offset + s.nbytes)
    if last.nbytes:
        with pytest.raises(LayoutError):
            validate_specs(specs, last.offset + last.nbytes - 1)


# --- schema_hash -----------------------------------------------------------------------------


def test_schema_hash_ignores_offsets() -> None:
    a = [TensorSpec("float32", (2, 3), 0), TensorSpec("float16", (4,), 64)]
    b = [TensorSpec("float32", (2, 3), 128), TensorSpec("float16", (4,), 512)]
    assert schema_hash(a) == schema_hash(b)
    assert len(schema_hash(a)) == 16


@pytest.mark.parametrize(
    "other",
    [
        [("float32", (3, 2)), ("float16", (4,))],  # shape permuted
        [("float32", (6,)), ("float16", (4,))],  # same numel, other shape
        [("float64", (2, 3)), ("float16", (4,))],  # dtype
        [("float16", (4,)), ("float32", (2, 3))],  # order
        [("float32", (2,)), ("float32", (3,)), ("float16", (4,))],  # split tensor
        [("float32", (2, 3))],  # tensor dropped
        [("float32", (2, 3)), ("float16", (4,)), ("float16", (0,))],  # empty tensor added
    ],
)
def test_schema_hash_differs(other: list[tuple[str, tuple[int, ...]]]) -> None:
    base = [("float32", (2, 3)), ("float16", (4,))]
    assert schema_hash(_layout(base)[0]) != schema_hash(_layout(other)[0])


@settings(max_examples=200, deadline=None)
@given(a=schemas, b=schemas)
def test_schema_hash_equal_iff_schema_equal(
    a: list[tuple[str, tuple[int, ...]]], b: list[tuple[str, tuple[int, ...]]]
) -> None:
    assume(a != b)
    assert schema_hash(_layout(a)[0]) != schema_hash(_layout(b)[0])
    assert schema_hash(_layout(a)[0]) == schema_hash(_layout(list(a))[0])
