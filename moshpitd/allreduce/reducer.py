"""Weighted accumulation of one owner's parts as contributions arrive, with exclusions.

A part is final once every sender that is still in the round has contributed to it. Excluding a
sender (it died, stalled past the round's deadline, or sent garbage) keeps what it already
delivered in the mean and finalises the parts that were waiting only for it. Each part's result
says exactly which senders it averages (a bitmask), so every returned element can be checked.

float32 and float16 parts accumulate in float32 (as gloo does), float64 in float64.

A robust aggregation (moshpitd/allreduce/robust.py) cannot accumulate: it keeps each sender's
contribution (one float64 row per sender, group size x part size per part) and aggregates the
rows that arrived when the part becomes final. The mean never allocates those rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from moshpitd.allreduce.layout import Part, all_finite
from moshpitd.allreduce.robust import aggregate, check_aggregation


class ReductionError(ValueError):
    """A contribution does not fit the part it claims to be, or is not a finite number."""


@dataclass
class _Slot:
    part: Part
    dtype: np.dtype
    acc: np.ndarray | None = None  # mean: Σ w·x so far; robust: one row per sender
    weight: float = 0.0
    mask: int = 0
    weights: np.ndarray | None = None  # robust: each sender's weight


class PartReducer:
    def __init__(self, parts: Iterable[Part], dtypes: dict[int, np.dtype], senders: int,
                 aggregation: str = "mean") -> None:
        self.expected = senders
        self.aggregation = check_aggregation(aggregation)
        self.excluded = 0  # bitmask of excluded senders
        self._slots = {p.index: _Slot(p, np.dtype(dtypes[p.run])) for p in parts}
        self._results: dict[int, np.ndarray] = {}
        self._scratch: np.ndarray | None = None

    def add(self, part_index: int, sender: int, weight: float, values: np.ndarray,
            trusted: bool = False) -> bool:
        """Adds one sender's part; True when the part became final with it. `trusted` skips
        the NaN/Inf check for values already checked (our own, checked per request)."""
        slot = self._slots.get(part_index)
        if slot is None:
            raise ReductionError(f"part {part_index} is not reduced here")
        bit = 1 << sender
        if not 0 <= sender < self.expected or self.excluded & bit:
            raise ReductionError(f"sender {sender} is not (or no longer) in this round")
        if slot.mask & bit:
            raise ReductionError(f"sender {sender} sent part {part_index} twice")
        if values.shape != (slot.part.numel,):
            raise ReductionError(
                f"part {part_index}: {values.size} elements, expected {slot.part.numel}"
            )
        if not trusted and not all_finite(values):
            raise ReductionError(f"sender {sender} sent non-finite values in part {part_index}")
        if self.aggregation != "mean":
            self._keep(slot, sender, weight, values)
            return self.is_final(part_index)
        acc_dtype = np.float64 if slot.dtype == np.float64 else np.float32
        if slot.acc is None:
            slot.acc = np.multiply(values, weight, dtype=acc_dtype)
        elif weight == 1.0:
            np.add(slot.acc, values, out=slot.acc)
        else:
            if self._scratch is None or self._scratch.size < values.size or \
                    self._scratch.dtype != acc_dtype:
                self._scratch = np.empty(max(values.size, slot.part.numel), dtype=acc_dtype)
            scaled = np.multiply(values, weight, out=self._scratch[:values.size], dtype=acc_dtype)
            np.add(slot.acc, scaled, out=slot.acc)
        slot.weight += weight
        slot.mask |= bit
        return self.is_final(part_index)

    def _keep(self, slot: _Slot, sender: int, weight: float, values: np.ndarray) -> None:
        if slot.acc is None:
            slot.acc = np.empty((self.expected, slot.part.numel), dtype=np.float64)
            slot.weights = np.zeros(self.expected)
        assert slot.weights is not None
        slot.acc[sender] = values  # the one copy: staging buffers are reused for the next part
        slot.weights[sender] = weight
        slot.weight += weight
        slot.mask |= 1 << sender

    def lacking(self, sender: int) -> int:
        """How many of our parts have nothing from sender yet."""
        bit = 1 << sender
        return sum(1 for slot in self._slots.values() if not slot.mask & bit)

    def exclude(self, sender: int) -> list[int]:
        """Stop waiting for sender; returns the parts that became final because of it."""
        bit = 1 << sender
        if self.excluded & bit:
            return []
        before = {i for i in self._slots if self.is_final(i)}
        self.excluded |= bit
        return [i for i in self._slots if i not in before and self.is_final(i)]

    def is_final(self, part_index: int) -> bool:
        waiting = ((1 << self.expected) - 1) & ~self.excluded
        return self._slots[part_index].mask & waiting == waiting

    def missing(self, part_index: int) -> int:
        """Bitmask of the senders still in the round that have not delivered the part."""
        waiting = ((1 << self.expected) - 1) & ~self.excluded
        return waiting & ~self._slots[part_index].mask

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
