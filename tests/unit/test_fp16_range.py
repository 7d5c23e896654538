"""A request with codec fp16 is refused when fp16 cannot carry its values (node.py): |x| above
65504 would be sent as Inf and the honest peer excluded as bad data. The same pass finds NaN and
Inf, in any chunk of any tensor."""

from __future__ import annotations

import numpy as np
import pytest

from moshpitd.allreduce.layout import FP16_MAX, LayoutError, TensorSpec, check_fp16_range

BIG = 600_000  # more than two of the check's chunks


def request(*arrays: np.ndarray) -> tuple[memoryview, list[TensorSpec]]:
    specs, offset = [], 0
    for a in arrays:
        specs.append(TensorSpec(str(a.dtype), a.shape, offset))
        offset += (a.nbytes + 63) // 64 * 64
    buffer = memoryview(bytearray(offset))
    for a, s in zip(arrays, specs, strict=True):
        buffer[s.offset:s.offset + a.nbytes] = a.tobytes()
    return buffer, specs


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("at", [0, 300_000, BIG - 1])
@pytest.mark.parametrize("value", [65505.0, -65520.0, 1e30])
def test_beyond_fp16_is_refused_with_advice(dtype: str, at: int, value: float) -> None:
    x = np.zeros(BIG, dtype=dtype)
    x[at] = value
    with pytest.raises(LayoutError, match=r"tensor 1 holds .*codec fp16.*65504.*bf16"):
        check_fp16_range(*request(np.ones(3, dtype=np.float16), x))


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_are_named(dtype: str, value: float) -> None:
    x = np.zeros(BIG, dtype=dtype)
    x[BIG - 2] = value
    with pytest.raises(LayoutError, match="tensor 0 contains NaN or Inf"):
        check_fp16_range(*request(x))


def test_values_fp16_carries_pass() -> None:
    edge = np.array([FP16_MAX, -FP16_MAX, 0.0, 1e-9], dtype=np.float32)
    check_fp16_range(*request(edge, np.zeros(0, dtype=np.float64),
                              np.full(BIG, -FP16_MAX, dtype=np.float64),
                              np.full(7, 65504, dtype=np.float16)))
    assert np.isfinite(edge.astype(np.float16)).all()  # the bound is really fp16's
    with np.errstate(over="ignore"):
        assert not np.isfinite(np.float32(65520).astype(np.float16))


@pytest.mark.parametrize("fp16", [False, True])
def test_check_part_names_the_tensor_inside_a_part_that_spans_several(fp16: bool) -> None:
    """Parts are checked one by one as they are sent (butterfly.py); a part that covers
    several tensors still names the one holding the bad value, and good parts pass."""
    from moshpitd.allreduce.layout import FlatView, Part

    a, b, c = np.ones(100, np.float32), np.ones(50, np.float32), np.ones(100, np.float32)
    b[49] = 1e6 if fp16 else np.nan
    specs, offset = [], 0
    for x in (a, b, c):  # back to back: one segment, parts cross tensor boundaries
        specs.append(TensorSpec("float32", x.shape, offset))
        offset += x.nbytes
    buffer = memoryview(bytearray(offset))
    for x, s in zip((a, b, c), specs, strict=True):
        buffer[s.offset:s.offset + x.nbytes] = x.tobytes()
    view = FlatView(buffer, specs)
    view.check_part(Part(0, 0, 0, 149, 0), fp16)
    view.check_part(Part(1, 0, 150, 250, 0), fp16)
    with pytest.raises(LayoutError, match="tensor 1 "):
        view.check_part(Part(2, 0, 120, 180, 0), fp16)
