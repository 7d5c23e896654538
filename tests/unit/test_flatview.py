"""FlatView over a buffer's tensors, spec validation and the schema hash."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from moshpitd.allreduce.layout import (
    FlatView,
    LayoutError,
    Part,
    TensorSpec,
    plan_parts,
    schema_hash,
    validate_specs,
)
from tests.unit.layout_cases import layout as _layout
from tests.unit.layout_cases import schemas, shares_st

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
