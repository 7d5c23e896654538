"""Replicas' local reduce: the weighted mean of a host's local trainers' tensors, computed in
shared memory into one scratch vector that then takes part in the swarm round as the host's.

The scratch is the daemon's, not a trainer's buffer: a round that fails leaves every trainer's
tensors as they were, and a trainer that goes away mid-round owns nothing the round uses.
The mean is accumulated chunk by chunk (a chunk of every replica in cache at once), so there is
one pass over each replica and one over the scratch, with no temporary the size of a tensor.
float16 accumulates in float32, as the all-reduce's reducers do.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moshpitd.allreduce.layout import FlatView, LayoutError, TensorSpec, all_finite
from moshpitd.ipc.schema import aligned

CHUNK = 1 << 16  # elements: a chunk of the scratch, the accumulator and a replica fit in L2
# float16 -> float32 by table: numpy's cast converts element by element (~8 ns each here),
# a lookup in this 256 KiB table (it stays in cache) takes ~2 ns, and is exact
_F16_TO_F32 = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)


def tensor_arrays(buffer: memoryview, specs: Sequence[TensorSpec]) -> list[np.ndarray]:
    """Each tensor as a flat view of the buffer (the specs were validated against it)."""
    return [np.frombuffer(buffer, dtype=s.dtype, count=s.numel, offset=s.offset)
            for s in specs]


class Scratch:
    """The host's vector for the swarm round: the tensors at aligned offsets in one array."""

    def __init__(self, specs: Sequence[TensorSpec]) -> None:
        laid, offset = [], 0
        for s in specs:
            offset = aligned(offset)
            laid.append(TensorSpec(s.dtype, s.shape, offset))
            offset += s.nbytes
        self.specs = tuple(laid)
        self.memory = np.empty(max(offset, 1), dtype=np.uint8).data
        self.arrays = tensor_arrays(self.memory, self.specs)
        self.view = FlatView(self.memory, self.specs)


def local_weights(weights: Sequence[float]) -> list[float]:
    """Each replica's share of the local mean: its weight over their sum (equal shares when
    every weight is 0: the host then takes part with weight 0, and its mean is still one)."""
    total = float(sum(weights))
    if total <= 0:
        return [1.0 / len(weights)] * len(weights)
    return [float(w) / total for w in weights]


def weighted_mean(dest: list[np.ndarray], sources: Sequence[list[np.ndarray]],
                  weights: Sequence[float]) -> dict[int, int]:
    """dest = sum of shares[i] * sources[i], tensor by tensor. Returns {} when every value
    was finite, else {source index: the first tensor where it holds NaN or Inf} for the
    sources found bad (dest is then incomplete: reduce again without them)."""
    shares = local_weights(weights)
    for t, out in enumerate(dest):
        acc_dtype = np.float32 if out.dtype == np.float16 else out.dtype
        acc = np.empty(min(CHUNK, out.size), dtype=acc_dtype)
        tmp = np.empty_like(acc)
        parts = [src[t] for src in sources]
        for lo in range(0, out.size, CHUNK):
            hi = min(lo + CHUNK, out.size)
            into = out[lo:hi] if out.dtype == acc_dtype else acc[:hi - lo]
            _scaled(parts[0][lo:hi], shares[0], into)
            for part, share in zip(parts[1:], shares[1:], strict=True):
                _scaled(part[lo:hi], share, tmp[:hi - lo])
                np.add(into, tmp[:hi - lo], out=into)
            if not all_finite(into):  # a mean of finite values is finite: a source is not
                bad = {i: t for i, part in enumerate(parts) if not all_finite(part[lo:hi])}
                if not bad:
                    raise LayoutError(f"tensor {t}: the local mean overflows its dtype")
                return bad
            if into is not out[lo:hi]:
                np.copyto(out[lo:hi], into, casting="same_kind")
    return {}


def _scaled(values: np.ndarray, share: float, out: np.ndarray) -> None:
    """out = share * values, in out's dtype (float32 for float16 values)."""
    if values.dtype == np.float16:
        np.take(_F16_TO_F32, values.view(np.uint16), out=out, mode="clip")  # unbuffered
        np.multiply(out, share, out=out)
    else:
        np.multiply(values, share, out=out)


def copy_out(src: list[np.ndarray], dests: Sequence[list[np.ndarray]]) -> None:
    """The result into every replica's tensors."""
    for dest in dests:
        for d, s in zip(dest, src, strict=True):
            np.copyto(d, s)
