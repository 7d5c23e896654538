"""Streaming DiLoCo's schedule (arXiv 2501.18512): the parameters in P fragments of about equal
size, fragment p synced at the steps where (step - p*H/P) mod H = 0, so each is synced once
every H steps and the syncs are spread over the H steps instead of all landing on one."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def split_fragments(sizes: Sequence[int], fragments: int) -> list[list[int]]:
    """Consecutive parameter indices in `fragments` groups of about equal numel; a tensor is
    never cut, so each group ends at the tensor boundary nearest its share."""
    if fragments < 1:
        raise ValueError(f"fragments must be >= 1, not {fragments}")
    if fragments > len(sizes):
        raise ValueError(f"fragments={fragments} needs at least {fragments} parameter tensors; "
                         f"there are {len(sizes)}")
    ends = np.cumsum(np.asarray(sizes, dtype=np.float64))  # ends[c - 1]: numel before c
    cuts = [0]
    for k in range(1, fragments):
        target = ends[-1] * k / fragments
        # at least one tensor in this fragment, and one left for each fragment after it
        lo, hi = cuts[-1] + 1, len(sizes) - (fragments - k)
        j = int(np.searchsorted(ends, target))  # ends[j - 1] < target <= ends[j]
        cuts.append(min((min(max(c, lo), hi) for c in (j, j + 1)),
                        key=lambda c: abs(ends[c - 1] - target)))
    cuts.append(len(sizes))
    return [list(range(a, b)) for a, b in itertools.pairwise(cuts)]


@dataclass(frozen=True)
class FragmentSchedule:
    every: int  # H: steps between two syncs of one fragment
    fragments: int  # P

    def __post_init__(self) -> None:
        if not 1 <= self.fragments <= self.every:
            raise ValueError(f"fragments must be between 1 and average_every ({self.every}), "
                             f"not {self.fragments}")

    def offset(self, fragment: int) -> int:
        return fragment * self.every // self.fragments

    def due(self, step: int) -> list[int]:
        """The fragments whose sync starts at local step `step` (counted from 1)."""
        if step < 1:
            return []
        return [p for p in range(self.fragments) if (step - self.offset(p)) % self.every == 0]
