"""Weighted accumulation of one owner's parts as they arrive from the group's senders."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from moshpitd.allreduce.layout import Part


class ReductionError(ValueError):
    """A contribution does not fit the part it claims to be."""


@dataclass
class _Slot:
    part: Part
    dtype: np.dtype
    acc: np.ndarray | None = None
    weight: float = 0.0
    senders: set[int] = field(default_factory=set)


class PartReducer:
    """Accumulates Σ w·x per part in float64 and yields Σ w·x / Σ w once all senders are in."""

    def __init__(self, parts: Iterable[Part], dtypes: dict[int, np.dtype], senders: int) -> None:
        self.expected = senders
        self._slots = {p.index: _Slot(p, np.dtype(dtypes[p.run])) for p in parts}

    def add(self, part_index: int, sender: int, weight: float, values: np.ndarray) -> bool:
        """Adds one sender's part; True when the part now has every expected contribution."""
        slot = self._slots.get(part_index)
        if slot is None:
            raise ReductionError(f"part {part_index} is not reduced here")
        if sender in slot.senders:
            raise ReductionError(f"sender {sender} sent part {part_index} twice")
        if values.shape != (slot.part.numel,):
            raise ReductionError(
                f"part {part_index}: {values.size} elements, expected {slot.part.numel}"
            )
        if slot.acc is None:
            slot.acc = np.multiply(values, weight, dtype=np.float64)
        else:
            slot.acc += np.multiply(values, weight, dtype=np.float64)
        slot.weight += weight
        slot.senders.add(sender)
        return len(slot.senders) >= self.expected

    def result(self, part_index: int) -> np.ndarray:
        slot = self._slots[part_index]
        if slot.acc is None or slot.weight <= 0:
            raise ReductionError(f"part {part_index} has no weighted contribution")
        return (slot.acc / slot.weight).astype(slot.dtype)

    def contributors(self, part_index: int) -> int:
        return len(self._slots[part_index].senders)
