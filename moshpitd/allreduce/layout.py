"""How a request's tensors map onto one flat vector, and how that vector is cut into parts.

The flat vector is the tensors' concatenation in request order, whatever their dtypes. Consecutive
tensors of one dtype form a *run*; a part never crosses a run, so every part has one dtype and its
bytes go on the wire as they lie in memory. Every peer of a group derives the same parts from the
same schema: nothing about the cut is negotiated.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

import msgpack
import numpy as np

from moshpitd.allreduce.codecs import CODECS, Codec
from moshpitd.ipc.schema import aligned

SUPPORTED_DTYPES = {"float16": np.float16, "float32": np.float32, "float64": np.float64}
DEFAULT_PART_BYTES = 1 << 20


_ZEROS: dict[np.dtype, np.ndarray] = {}
_CHUNK = 1 << 18
_LOCAL = threading.local()  # per-thread scratch: requests are checked in worker threads
FP16_MAX = 65504.0  # fp16 encodes anything larger as Inf, which every reducer refuses


def all_finite(values: np.ndarray) -> bool:
    """No NaN or Inf, in one pass with no temporary: a dot product with zeros is NaN exactly
    when some element is NaN or ±Inf (0·Inf = NaN), and BLAS reads the input once.
    (np.isfinite allocates a mask the size of the input; max and min take two passes.)"""
    if values.size == 0:
        return True
    if values.dtype == np.float16 and values.ndim == 1:
        return _f16_finite(values)
    if values.dtype not in (np.float32, np.float64) or values.ndim != 1:
        return math.isfinite(float(values.max())) and math.isfinite(float(values.min()))
    zeros = _ZEROS.get(values.dtype)
    if zeros is None:
        zeros = _ZEROS[values.dtype] = np.zeros(_CHUNK, dtype=values.dtype)
    with np.errstate(invalid="ignore"):  # 0·Inf is the very NaN we look for
        for start in range(0, values.size, _CHUNK):
            chunk = values[start:start + _CHUNK]
            if math.isnan(float(np.dot(chunk, zeros[:chunk.size]))):
                return False
    return True


def _f16_finite(values: np.ndarray) -> bool:
    """float16 NaN and Inf have all exponent bits set: |bits| >= 0x7C00. Integer max runs in
    SIMD; a float16 max or min converts element by element (~60x slower)."""
    scratch = getattr(_LOCAL, "f16", None)
    if scratch is None:
        scratch = _LOCAL.f16 = np.empty(_CHUNK, dtype=np.uint16)
    bits = values.view(np.uint16)
    for start in range(0, bits.size, _CHUNK):
        chunk = bits[start:start + _CHUNK]
        if np.bitwise_and(chunk, 0x7FFF, out=scratch[:chunk.size]).max() >= 0x7C00:
            return False
    return True


class LayoutError(ValueError):
    """A tensor description does not fit the buffer or is not supported."""


def check_fp16_range(buffer: memoryview, specs: Sequence[TensorSpec]) -> None:
    """NaN, Inf and values codec fp16 cannot carry (it would send them as Inf)."""
    FlatView(buffer, specs).check_finite(fp16=True)


@dataclass(frozen=True)
class TensorSpec:
    dtype: str
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the shared buffer

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Run:
    """Consecutive tensors of one dtype; element indices are local to the run."""

    dtype: str
    numel: int
    tensors: tuple[int, ...]  # indices into the request's tensor list


@dataclass(frozen=True)
class Part:
    index: int
    run: int
    start: int
    stop: int
    owner: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def schema_of(specs: Sequence[TensorSpec]) -> list[tuple[str, tuple[int, ...]]]:
    return [(s.dtype, s.shape) for s in specs]


def schema_hash(specs: Sequence[TensorSpec], codec: str = "none",
                aggregation: str = "mean", part_bytes: int = DEFAULT_PART_BYTES,
                encrypted: bool = False, checked: bool = False) -> bytes:
    """Peers may only average tensors of identical dtypes and shapes, in the same order, sent
    with the same wire codec, aggregated the same way and cut into the same parts (every
    member plans the parts itself), over streams encrypted alike (a stream between an
    encrypting peer and one that does not is refused, so a mixed group would stall to its
    deadline). Defaults hash as they always did."""
    fields: list[object] = [[[d, list(shape)] for d, shape in schema_of(specs)], codec]
    if aggregation != "mean":
        fields.append(aggregation)
    if part_bytes != DEFAULT_PART_BYTES:
        fields.append(["part_bytes", part_bytes])
    if codec != "none":  # parts are sized by their encoded bytes (they used to be by raw bytes)
        fields.append(["wire_sized", 1])
    if codec == "int8":  # parts start on block boundaries (they used not to)
        fields.append(["block_aligned", 1])
    if encrypted:
        fields.append(["encrypted", 1])
    if checked:  # every member checks results: one that does not would stall every check
        fields.append(["checked", 1])
    packed = msgpack.packb(fields)
    return hashlib.sha256(packed).digest()[:16]


def validate_specs(specs: Sequence[TensorSpec], buffer_size: int) -> None:
    if not specs:
        raise LayoutError("a request needs at least one tensor")
    for i, s in enumerate(specs):
        if s.dtype not in SUPPORTED_DTYPES:
            raise LayoutError(
                f"tensor {i}: dtype {s.dtype!r} is not supported "
                f"(use one of {', '.join(SUPPORTED_DTYPES)})"
            )
        if any(d < 0 for d in s.shape):
            raise LayoutError(f"tensor {i}: negative dimension in shape {s.shape}")
        itemsize = np.dtype(s.dtype).itemsize
        if s.offset < 0 or s.offset % itemsize:
            raise LayoutError(f"tensor {i}: offset {s.offset} is not aligned to {itemsize} bytes")
        if s.offset + s.nbytes > buffer_size:
            raise LayoutError(
                f"tensor {i}: bytes {s.offset}..{s.offset + s.nbytes} lie outside the shared "
                f"buffer of {buffer_size} bytes"
            )


def runs_of(specs: Sequence[TensorSpec]) -> list[Run]:
    runs: list[Run] = []
    current: list[int] = []
    for i, s in enumerate(specs):
        if current and specs[current[-1]].dtype != s.dtype:
            runs.append(_make_run(specs, current))
            current = []
        current.append(i)
    if current:
        runs.append(_make_run(specs, current))
    return [r for r in runs if r.numel > 0]


def _make_run(specs: Sequence[TensorSpec], idx: list[int]) -> Run:
    return Run(specs[idx[0]].dtype, sum(specs[i].numel for i in idx), tuple(idx))


def span_bounds(total: int, shares: Sequence[float]) -> list[int]:
    """Cut [0, total) into len(shares) spans proportional to shares; returns n+1 bounds."""
    arr = np.asarray(shares, dtype=np.float64)
    if arr.size == 0 or not np.isfinite(arr).all() or (arr < 0).any() or arr.max() <= 0:
        raise ValueError("shares must be finite, non-negative, with a positive sum")
    cum = np.concatenate([[0.0], np.cumsum(arr / arr.max())])
    bounds = np.floor(cum / cum[-1] * total + 0.5).astype(np.int64)
    bounds[-1] = total
    return [int(b) for b in bounds]


# The most of the vector one owner reduces, in equal shares among the owners (members with a
# share above 0). Bandwidths are self-reported and a reducer decides its span's result: one
# declaring a huge bandwidth would otherwise reduce, and see, nearly the whole vector.
SHARE_CAP = 2.0


def capped_shares(shares: Sequence[float], cap: float = SHARE_CAP) -> list[float]:
    """`shares` as fractions of the vector, none above `cap` equal shares: the excess goes to
    the other owners in proportion to their shares (water-filling, one pass per newly capped
    owner). Every member computes the same from the same shares. Shares that span_bounds
    would refuse are returned as they are, for it to refuse."""
    arr = np.asarray(shares, dtype=np.float64)
    if arr.size == 0 or not np.isfinite(arr).all() or (arr < 0).any() or arr.max() <= 0:
        return list(shares)
    owners = arr > 0
    limit = cap / int(owners.sum())
    x = arr / arr.max()  # the largest is 1: the sum cannot overflow
    x /= x.sum()
    fixed = np.zeros(arr.size, dtype=bool)
    while True:
        over = ~fixed & (x > limit * (1 + 1e-9))
        if not over.any():
            return [float(v) for v in x]
        fixed |= over
        x[fixed] = limit
        free = owners & ~fixed  # what the capped ones gave up, spread over the rest
        x[free] *= (1.0 - limit * int(fixed.sum())) / x[free].sum()


def plan_parts(runs: Sequence[Run], shares: Sequence[float],
               part_bytes: int = DEFAULT_PART_BYTES, codec: Codec = CODECS["none"]
               ) -> list[Part]:
    """Every (run, span) intersection cut into parts of at most part_bytes on the wire (no
    span above SHARE_CAP equal shares, see capped_shares): a
    codec that compresses gets parts with more values, so a part costs the same per frame.
    With a block codec (int8, int4) every part starts on a block boundary of its run (span
    bounds move to the nearest one), so the run encoded whole has the round's blocks."""
    total = sum(r.numel for r in runs)
    bounds = span_bounds(total, capped_shares(shares))
    block = codec.block
    parts: list[Part] = []
    run_start = 0
    for run_idx, run in enumerate(runs):
        step = codec.max_elements(part_bytes, np.dtype(run.dtype))
        step = max(block, step // block * block)
        run_stop = run_start + run.numel
        cuts = [b if b <= run_start or b >= run_stop else
                min(run_start + (b - run_start + block // 2) // block * block, run_stop)
                for b in bounds]
        for owner in range(len(shares)):
            lo, hi = max(cuts[owner], run_start), min(cuts[owner + 1], run_stop)
            for start in range(lo, hi, step):
                stop = min(start + step, hi)
                parts.append(Part(len(parts), run_idx, start - run_start, stop - run_start, owner))
        run_start = run_stop
    return parts


class FlatView:
    """Reads and writes parts of the flat vector in the shared buffer, in place.

    Tensors of a run that lie back to back in the buffer form one *segment*, so a part that
    crosses their boundary is still one slice of memory; only a gap between tensors (alignment
    padding) splits a part into pieces, which then travel as separate payloads."""

    def __init__(self, buffer: memoryview, specs: Sequence[TensorSpec]) -> None:
        validate_specs(specs, len(buffer))
        self.specs = list(specs)
        self.runs = runs_of(specs)
        self._arrays = [
            np.frombuffer(buffer, dtype=s.dtype, count=s.numel, offset=s.offset)
            for s in self.specs
        ]
        self._base = np.frombuffer(buffer, dtype=np.uint8).ctypes.data if len(buffer) else 0
        self._views: dict[tuple[int, int, int], list[np.ndarray]] = {}
        # per run: (element offset inside the run, array) of each segment, then the run's end
        self._segments: list[list[tuple[int, np.ndarray]]] = []
        self._starts: list[list[int]] = []
        for run in self.runs:
            segments: list[tuple[int, np.ndarray]] = []
            pos, seg_start, seg_offset, seg_end, seg_numel = 0, 0, -1, -1, 0
            for i in run.tensors:
                s = self.specs[i]
                if s.numel == 0:
                    continue
                if s.offset != seg_end:  # not adjacent: close the segment, open another
                    if seg_numel:
                        segments.append((seg_start, np.frombuffer(
                            buffer, run.dtype, seg_numel, seg_offset)))
                    seg_start, seg_offset, seg_numel = pos, s.offset, 0
                seg_numel += s.numel
                seg_end = s.offset + s.nbytes
                pos += s.numel
            if seg_numel:
                segments.append((seg_start, np.frombuffer(buffer, run.dtype, seg_numel,
                                                          seg_offset)))
            self._segments.append(segments)
            self._starts.append([start for start, _ in segments] + [run.numel])

    def views(self, part: Part) -> list[np.ndarray]:
        """The part's values as views of the buffer, in order (one unless there is a gap).
        Computed once per part (a round asks several times): callers must not modify it."""
        key = (part.run, part.start, part.stop)
        out = self._views.get(key)
        if out is None:
            out = self._views[key] = self._cut(part)
        return out

    def _cut(self, part: Part) -> list[np.ndarray]:
        segments, starts = self._segments[part.run], self._starts[part.run]
        k = bisect.bisect_right(starts, part.start) - 1
        out = []
        while starts[k] < part.stop:
            seg_start, arr = segments[k]
            out.append(arr[max(part.start, seg_start) - seg_start:
                           min(part.stop, starts[k + 1]) - seg_start])
            k += 1
        return out

    def read(self, part: Part) -> np.ndarray:
        """A view when the part is one slice of memory, else a gathered copy."""
        pieces = self.views(part)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def pack(self) -> tuple[bytes, list[list[Any]]]:
        # the tensors copied into one contiguous snapshot (BUFFER_ALIGN-aligned: a joiner's
        # client reads them where they land in its shared buffer), with their
        # [dtype, shape, offset] in it
        specs: list[list[Any]] = []
        offset = 0
        for spec in self.specs:
            offset = aligned(offset)
            specs.append([spec.dtype, list(spec.shape), offset])
            offset += spec.nbytes
        out = bytearray(offset)
        for (_, _, off), arr in zip(specs, self._arrays, strict=True):
            out[off:off + arr.nbytes] = arr.data.cast("B")
        return bytes(out), specs

    def check_finite(self, fp16: bool = False) -> None:
        """No NaN or Inf; with `fp16`, nothing beyond its range either."""
        for i, arr in enumerate(self._arrays):
            _check_values(i, arr.reshape(-1), fp16)

    def check_part(self, part: Part, fp16: bool = False) -> None:
        """`check_finite` for one part."""
        for piece in self.views(part):
            self.check_piece(piece, fp16)

    def check_piece(self, piece: np.ndarray, fp16: bool = False) -> None:
        """`check_finite` for a view of this buffer, naming the tensor at fault."""
        try:
            _check_values(-1, piece, fp16)
        except LayoutError:
            self._name_culprit(piece, fp16)
            raise

    def _name_culprit(self, piece: np.ndarray, fp16: bool) -> None:
        """Raises the error for the tensor that holds the piece's bad value."""
        start = piece.ctypes.data - self._base
        stop = start + piece.nbytes
        for i, s in enumerate(self.specs):
            lo, hi = max(start, s.offset), min(stop, s.offset + s.nbytes)
            if lo < hi:
                size = self._arrays[i].itemsize
                _check_values(i, self._arrays[i].reshape(-1)[(lo - s.offset) // size:
                                                             (hi - s.offset) // size], fp16)

    def write(self, part: Part, values: np.ndarray) -> None:
        pos = 0
        for piece in self.views(part):
            piece[:] = values[pos:pos + piece.size]
            pos += piece.size


def _check_values(i: int, flat: np.ndarray, fp16: bool) -> None:
    """Raises LayoutError naming tensor i. With `fp16`: one pass of min and max per
    cache-sized chunk (every finite float16 fits, so those need no more)."""
    if not fp16 or flat.dtype == np.float16:
        if not all_finite(flat):
            raise LayoutError(f"tensor {i} contains NaN or Inf: refusing to average it")
        return
    for chunk in (flat[k:k + _CHUNK] for k in range(0, flat.size, _CHUNK)):
        lo, hi = chunk.min(), chunk.max()
        if not (np.isfinite(lo) and np.isfinite(hi)):
            raise LayoutError(f"tensor {i} contains NaN or Inf: refusing to average it")
        if max(-lo, hi) > FP16_MAX:
            raise LayoutError(f"tensor {i} holds {max(-lo, hi):.6g}, beyond codec fp16's "
                              "range (|x| <= 65504; it would arrive as Inf): use bf16")


def specs_from_wire(tensors: Sequence[Any]) -> tuple[TensorSpec, ...]:
    """Validate the IPC description of tensors: [[dtype, shape, offset], ...]."""
    specs = []
    for i, t in enumerate(tensors):
        if not (isinstance(t, list | tuple) and len(t) == 3):
            raise ValueError(f"tensor {i}: expected [dtype, shape, offset]")
        dtype, shape, offset = t
        if not isinstance(dtype, str) or not isinstance(offset, int) or isinstance(offset, bool):
            raise ValueError(f"tensor {i}: dtype must be a string and offset an integer")
        if not isinstance(shape, list | tuple) or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in shape
        ) or len(shape) > 32:
            raise ValueError(f"tensor {i}: shape must be a list of at most 32 integers")
        specs.append(TensorSpec(dtype, tuple(shape), offset))
    return tuple(specs)
