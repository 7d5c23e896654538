"""Weighted accumulation of one owner's parts as contributions arrive, with exclusions.

A part is final once every sender that is still in the round has contributed to it; senders of
weight 0 (listeners: a joiner, say) are not waited for, and contribute nothing. Excluding a
sender (it died, stalled past the round's deadline, or sent garbage) keeps what it already
delivered in the mean and finalises the parts that were waiting only for it. Each part's result
says exactly which senders it averages (a bitmask), so every returned element can be checked.

float32 and float16 parts accumulate in float32 (as gloo does), float64 in float64.

A robust aggregation (moshpitd/allreduce/robust.py) cannot accumulate: it keeps each sender's
contribution (one float64 row per sender, group size x part size per part) and aggregates the
rows that arrived when the part becomes final. The mean never allocates those rows.

Our own contribution to a part that lies in one piece of the trainer's buffer is not copied: that
piece becomes the part's accumulator (`seed`), and the result is scaled in place. Nothing else
writes there during the round, and `settle` divides whatever arrived so far if the round ends
early, so the buffer never holds a bare sum.

The other accumulators come from a pool shared by the daemon's rounds: a fresh array per part
costs a page fault per 4 KiB (the kernel zeroes each page) and starts cold in the cache. A part
whose result is written out with `result_into` gives its accumulator back at once, so a round
cycles through about as many accumulators as it has parts in flight.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from moshpitd.allreduce.layout import Part, all_finite
from moshpitd.allreduce.robust import aggregate, check_aggregation


class ReductionError(ValueError):
    """A contribution does not fit the part it claims to be, or is not a finite number."""


class ArrayPool:
    """Free 1-D arrays by dtype, up to max_bytes in all; `take` hands out a slice of one that
    is large enough (or a new array), `give` takes back what `take` handed out."""

    def __init__(self, max_bytes: int, best_fit: bool = False) -> None:
        self.max_bytes = max_bytes
        self.held = 0
        self.best_fit = best_fit  # the smallest array that is large enough, not the warmest:
        # for buffers of mixed sizes held together (a small request must not take a large one)
        self._free: dict[np.dtype, list[np.ndarray]] = {}
        self._sized: dict[tuple[np.dtype, int], list[np.ndarray]] = {}  # best_fit's, by size

    def take(self, n: int, dtype: np.dtype) -> np.ndarray:
        if self.best_fit:  # a few distinct sizes (a round's parts are alike): scan those
            sizes = [size for (dt, size), arrs in self._sized.items()
                     if dt == dtype and size >= n and arrs]
            if not sizes:
                return np.empty(n, dtype=dtype)
            base = self._sized[dtype, min(sizes)].pop()
            self.held -= base.nbytes
            return base[:n]
        free = self._free.get(dtype, [])
        for i in range(len(free) - 1, -1, -1):  # the most recently given back: warm in cache
            if free[i].size >= n:
                base = free.pop(i)
                self.held -= base.nbytes
                return base[:n]
        return np.empty(n, dtype=dtype)

    def give(self, arr: np.ndarray) -> None:
        base = arr if arr.base is None else arr.base
        if isinstance(base, np.ndarray) and base.ndim == 1 and \
                self.held + base.nbytes <= self.max_bytes:
            if self.best_fit:
                self._sized.setdefault((base.dtype, base.size), []).append(base)
            else:
                self._free.setdefault(base.dtype, []).append(base)
            self.held += base.nbytes


ACCUMULATORS = ArrayPool(32 << 20)


@dataclass
class _Slot:
    part: Part
    dtype: np.dtype
    acc: np.ndarray | None = None  # mean: Σ w·x so far; robust: one row per sender
    weight: float = 0.0
    mask: int = 0
    weights: np.ndarray | None = None  # robust: each sender's weight
    borrowed: bool = False  # acc is a piece of the trainer's buffer: never pooled


class PartReducer:
    def __init__(self, parts: Iterable[Part], dtypes: dict[int, np.dtype], senders: int,
                 aggregation: str = "mean", pool: ArrayPool = ACCUMULATORS,
                 listeners: int = 0) -> None:
        self.expected = senders
        self.listeners = listeners  # bitmask of senders of weight 0: not waited for
        self.pool = pool
        self.aggregation = check_aggregation(aggregation)
        self.excluded = 0  # bitmask of excluded senders
        self._slots = {p.index: _Slot(p, np.dtype(dtypes[p.run])) for p in parts}
        self._results: dict[int, np.ndarray] = {}
        self._scratch: np.ndarray | None = None

    def add(self, part_index: int, sender: int, weight: float,
            values: np.ndarray | Sequence[np.ndarray], trusted: bool = False) -> bool:
        """Adds one sender's part (an array, or pieces that follow one another); True when the
        part became final with it. `trusted` skips the NaN/Inf check for values already
        checked (our own, checked per request)."""
        slot = self._slots.get(part_index)
        if slot is None:
            raise ReductionError(f"part {part_index} is not reduced here")
        bit = 1 << sender
        if not 0 <= sender < self.expected or self.excluded & bit:
            raise ReductionError(f"sender {sender} is not (or no longer) in this round")
        if self.listeners & bit:
            raise ReductionError(f"sender {sender} has weight 0 in this round: it contributes "
                                 "nothing")
        if slot.mask & bit:
            raise ReductionError(f"sender {sender} sent part {part_index} twice")
        if isinstance(values, np.ndarray):
            pieces = [values]
        elif isinstance(values, list | tuple):
            pieces = list(values)
        else:
            raise ReductionError(f"part {part_index}: values of type {type(values).__name__}")
        if any(p.ndim != 1 for p in pieces) or sum(p.size for p in pieces) != slot.part.numel:
            raise ReductionError(f"part {part_index}: {sum(p.size for p in pieces)} elements "
                                 f"in shapes {[p.shape for p in pieces]}, expected "
                                 f"{slot.part.numel}")
        if not trusted and not all(all_finite(p) for p in pieces):
            raise ReductionError(f"sender {sender} sent non-finite values in part {part_index}")
        if self.aggregation != "mean":
            self._keep(slot, sender, weight, pieces)
            return self.is_final(part_index)
        acc_dtype = np.dtype(np.float64 if slot.dtype == np.float64 else np.float32)
        first = slot.acc is None
        if first:
            slot.acc = self.pool.take(slot.part.numel, acc_dtype)
        assert slot.acc is not None
        pos = 0
        for piece in pieces:
            acc = slot.acc[pos:pos + piece.size]
            pos += piece.size
            if first and weight == 1.0:
                np.copyto(acc, piece)
            elif first:
                np.multiply(piece, weight, out=acc, dtype=acc_dtype)
            elif weight == 1.0:
                np.add(acc, piece, out=acc)  # casts a float16 piece on the fly
            else:
                np.add(acc, self._scaled(piece, weight, acc_dtype), out=acc)
        slot.weight += weight
        slot.mask |= bit
        return self.is_final(part_index)

    def seed(self, part_index: int, sender: int, weight: float,
             target: np.ndarray | Sequence[np.ndarray]) -> bool:
        """Adds our own (trusted) values by accumulating in place in `target`, where they are
        (one piece of the trainer's buffer). Falls back to `add` where that cannot work: a
        robust aggregation, a dtype that accumulates wider, a weight of 0 (the local values
        must survive a round with no average). True when the part became final with it."""
        slot = self._slots.get(part_index)
        if not isinstance(target, np.ndarray) or slot is None or slot.acc is not None \
                or self.aggregation != "mean" or target.dtype not in (np.float32, np.float64) \
                or target.ndim != 1 or target.size != slot.part.numel or not weight > 0 \
                or not 0 <= sender < self.expected:
            return self.add(part_index, sender, weight, target, trusted=True)
        if weight != 1.0:
            np.multiply(target, weight, out=target)
        slot.acc, slot.borrowed = target, True
        slot.weight += weight
        slot.mask |= 1 << sender
        return self.is_final(part_index)

    def settle(self) -> None:
        """The round ends with parts still open: an accumulator that is the trainer's buffer
        gets the mean of what arrived (never a bare sum)."""
        for index, slot in self._slots.items():
            if slot.borrowed and slot.acc is not None and index not in self._results:
                if slot.weight != 1.0:
                    slot.acc *= 1.0 / slot.weight
                slot.acc = None

    def _scaled(self, values: np.ndarray, weight: float, dtype: np.dtype) -> np.ndarray:
        if self._scratch is None or self._scratch.size < values.size or \
                self._scratch.dtype != dtype:
            self._scratch = np.empty(values.size, dtype=dtype)
        return np.multiply(values, weight, out=self._scratch[:values.size], dtype=dtype)

    def _keep(self, slot: _Slot, sender: int, weight: float, pieces: list[np.ndarray]) -> None:
        if slot.acc is None:
            slot.acc = np.empty((self.expected, slot.part.numel), dtype=np.float64)
            slot.weights = np.zeros(self.expected)
        assert slot.weights is not None
        pos = 0
        for piece in pieces:  # the one copy: staging buffers are reused for the next part
            slot.acc[sender, pos:pos + piece.size] = piece
            pos += piece.size
        slot.weights[sender] = weight
        slot.weight += weight
        slot.mask |= 1 << sender

    def lacking(self, sender: int) -> int:
        """How many of our parts have nothing from sender yet."""
        bit = 1 << sender
        if self.listeners & bit:
            return 0
        return sum(1 for slot in self._slots.values() if not slot.mask & bit)

    def exclude(self, sender: int) -> list[int]:
        """Stop waiting for sender; returns the parts that became final because of it."""
        bit = 1 << sender
        if self.excluded & bit:
            return []
        before = {i for i in self._slots if self.is_final(i)}
        self.excluded |= bit
        return [i for i in self._slots if i not in before and self.is_final(i)]

    @property
    def waiting(self) -> int:
        """Bitmask of the senders whose contributions a part waits for."""
        return ((1 << self.expected) - 1) & ~self.excluded & ~self.listeners

    def is_final(self, part_index: int) -> bool:
        waiting = self.waiting
        return self._slots[part_index].mask & waiting == waiting

    def missing(self, part_index: int) -> int:
        """Bitmask of the senders still in the round that have not delivered the part."""
        return self.waiting & ~self._slots[part_index].mask

    def mask(self, part_index: int) -> int:
        """Senders averaged into the part's result; 0 when there is no average."""
        slot = self._slots[part_index]
        return slot.mask if slot.weight > 0 else 0  # a positive weight came with values

    def result(self, part_index: int) -> np.ndarray:
        """Σ w·x / Σ w in the part's dtype, computed once (in place when dtypes agree)."""
        done = self._results.get(part_index)
        if done is not None:
            return done
        slot = self._slots[part_index]
        if slot.acc is None and slot.weight > 0:
            raise ReductionError(f"part {part_index}: its result was written out already")
        if slot.acc is None or slot.weight <= 0:
            raise ReductionError(f"part {part_index} has no weighted contribution")
        if self.aggregation != "mean":
            return self._robust(part_index, slot)
        if not self.is_final(part_index):  # a preview: leave the accumulator alone
            return (slot.acc / slot.weight).astype(slot.dtype)
        if slot.acc.dtype == slot.dtype:
            slot.acc *= 1.0 / slot.weight  # nothing more can be added: reuse its memory
            out = slot.acc
        else:
            out = (slot.acc / slot.weight).astype(slot.dtype)
        self._results[part_index] = out
        return out

    def result_into(self, part_index: int, out: Sequence[np.ndarray]) -> None:
        """Writes the final result into `out` (pieces that follow one another, e.g. the
        trainer's buffer), scaling straight from the accumulator, which goes back to the
        pool: no result array, no second pass. `result` cannot be asked for afterwards."""
        slot = self._slots[part_index]
        if self.aggregation != "mean" or part_index in self._results or slot.acc is None \
                or slot.weight <= 0 or not self.is_final(part_index):
            values = self.result(part_index)  # raises when there is no result
            pos = 0
            for piece in out:
                piece[:] = values[pos:pos + piece.size]
                pos += piece.size
            return
        acc, pos = slot.acc, 0
        for piece in out:
            src = acc[pos:pos + piece.size]
            pos += piece.size
            if piece.dtype == acc.dtype:  # as `result` computes it, rounding included
                if slot.weight != 1.0 or not slot.borrowed:  # borrowed: src is piece
                    np.multiply(src, 1.0 / slot.weight, out=piece)
            else:
                np.divide(src, slot.weight, out=piece)
        slot.acc = None
        if not slot.borrowed:
            self.pool.give(acc)

    def _robust(self, part_index: int, slot: _Slot) -> np.ndarray:
        """The aggregate of the rows that arrived; once final, computed once and the rows
        freed."""
        assert slot.acc is not None and slot.weights is not None
        rows = [i for i in range(self.expected) if slot.mask >> i & 1]  # over senders
        final = self.is_final(part_index)
        if len(rows) == self.expected:
            stack, weights, scratch = slot.acc, slot.weights, final
        else:  # an excluded sender's row was never filled
            stack, weights, scratch = slot.acc[rows], slot.weights[rows], True
        out = aggregate(self.aggregation, stack, weights, overwrite=scratch)
        out = out.astype(slot.dtype, copy=False)
        if final:
            self._results[part_index] = out
            slot.acc = slot.weights = None
        return out

    def contributors(self, part_index: int) -> int:
        return bin(self._slots[part_index].mask).count("1")
