"""Flat-vector layout: runs, span bounds, part plans (FlatView and specs: test_flatview.py)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moshpitd.allreduce.layout import (
    Part,
    Run,
    capped_shares,
    plan_parts,
    runs_of,
    span_bounds,
)
from tests.unit.layout_cases import layout as _layout
from tests.unit.layout_cases import schemas, shares_st

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
