"""The Moshpit grid (paper, Algorithm 1): pure key logic shared by the daemon and the simulator.

Peers sit on a virtual d-dimensional grid with M cells per dimension and keep their coordinates
for a whole run. Round r averages along axis a = r mod d: peers whose coordinates agree on every
axis but a share a group key, so each group is one line of the grid. On a full grid with no
failures, d consecutive rounds give every peer the exact global mean, from any starting round.

The round number is global per run: a peer that missed rounds (failed, slow, just joined) catches
up to the latest round its peers declared before it declares itself, so it never falls out of
phase with the grid (docs/architecture.md, "Matchmaking", says why hivemind's shift-register
keys do worse).
"""

from __future__ import annotations

import operator
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import product
from typing import TypeVar

Coords = tuple[int, ...]
MAX_CELLS = 1 << 20
MAX_DIMS = 20
T = TypeVar("T")


class GridError(ValueError):
    """A grid or coordinates that cannot be used."""


@dataclass(frozen=True)
class Grid:
    size: int  # M: cells per dimension, also the target group size
    dims: int  # d

    def __post_init__(self) -> None:
        if not (isinstance(self.size, int) and isinstance(self.dims, int)):
            raise GridError("grid size and dimensions must be integers")
        if self.size < 1 or not 1 <= self.dims <= MAX_DIMS:
            raise GridError(f"grid {self.size}^{self.dims}: need M >= 1 and 1 <= d <= {MAX_DIMS}")
        if self.size ** self.dims > MAX_CELLS:
            raise GridError(f"grid {self.size}^{self.dims} has more than {MAX_CELLS} cells")

    @classmethod
    def parse(cls, text: str) -> Grid:
        """'8x8' or '4x4x4' (all dimensions equal)."""
        try:
            sizes = [int(x) for x in text.lower().split("x")]
        except ValueError:
            raise GridError(f"grid {text!r}: expected MxM[xM...]") from None
        if not sizes or len(set(sizes)) != 1:
            raise GridError(f"grid {text!r}: every dimension must have the same size")
        return cls(sizes[0], len(sizes))

    @property
    def cells(self) -> int:
        return int(self.size ** self.dims)

    def axis(self, round_: int) -> int:
        return round_ % self.dims

    def check(self, coords: Sequence[int]) -> Coords:
        try:
            if any(isinstance(x, bool) for x in coords):
                raise TypeError
            c = tuple(operator.index(x) for x in coords)
        except TypeError:
            raise GridError(f"coordinates {list(coords)} must be integers") from None
        if len(c) != self.dims or not all(0 <= x < self.size for x in c):
            raise GridError(f"coordinates {c} do not fit grid {self.size}^{self.dims}")
        return c

    def line(self, round_: int, coords: Coords) -> Coords:
        """The coordinates that name this round's group: all but the averaging axis."""
        a = self.axis(round_)
        return coords[:a] + coords[a + 1:]

    def group_key(self, run: str, round_: int, coords: Coords) -> str:
        line = ".".join(str(x) for x in self.line(round_, coords))
        return f"{run}/{round_}/{line}"

    def all_cells(self) -> Iterable[Coords]:
        return product(range(self.size), repeat=self.dims)


def choose_coords(grid: Grid, occupancy: Mapping[Coords, int], rng: random.Random,
                  initial: Sequence[int] | None = None,
                  cells: Sequence[Coords] | None = None) -> Coords:
    """initial_coords if given, else the emptiest cell we can see (ties at random): among
    `cells` (those of the lines we read) when given."""
    if initial is not None:
        return grid.check(initial)
    if cells:
        least = min(occupancy.get(c, 0) for c in cells)
        return rng.choice([c for c in cells if occupancy.get(c, 0) == least])
    if not occupancy:
        return tuple(rng.randrange(grid.size) for _ in range(grid.dims))
    if grid.cells <= 4096:
        counts = {c: occupancy.get(c, 0) for c in grid.all_cells()}
        least = min(counts.values())
        return rng.choice([c for c, n in counts.items() if n == least])
    # large grids: sample cells and keep the emptiest seen (an empty one almost surely)
    best: Coords | None = None
    for _ in range(256):
        c = tuple(rng.randrange(grid.size) for _ in range(grid.dims))
        if best is None or occupancy.get(c, 0) < occupancy.get(best, 0):
            best = c
        if occupancy.get(best, 0) == 0:
            break
    assert best is not None
    return best


def split_bucket(members: Sequence[T], target: int, rng: random.Random) -> list[list[T]]:
    """An overfull bucket (more peers than the target under one key) split at random into
    groups of at most target, as even as possible."""
    if target < 1:
        raise GridError("target group size must be >= 1")
    shuffled = list(members)
    rng.shuffle(shuffled)
    groups = max(1, -(-len(shuffled) // target))
    return [shuffled[i::groups] for i in range(groups)] if shuffled else []


def catch_up(own_round: int, declared: Iterable[int]) -> int:
    """The round to join: never behind the latest round any peer of the run declared."""
    return max([own_round, *declared])


def plan_round(grid: Grid, own_round: int, coords: Coords,
               peers: Iterable[tuple[Coords, int]]) -> int:
    """The round to average in next: catch up over rounds that are over for us, never more.

    A round r is over for us when every line-mate of round r has declared a later round (the
    group formed without us), or when we have no line-mate in r while someone is already past
    it. Jumping straight to the swarm's latest round instead would make a peer that is a few
    milliseconds late skip a round its line-mates are waiting for, and knock the grid out of
    phase (d rounds would no longer give the exact mean)."""
    rounds = [(c, r) for c, r in peers]
    if not rounds:
        return own_round
    start = max(own_round, min(pr for _, pr in rounds))
    top = max(pr for _, pr in rounds)
    if start >= top:
        return start
    # The first r in [start, top) with a line-mate that has not passed r, found without
    # walking the rounds (their numbers come from peers): a peer shares our line on the axes
    # where it differs from us in no other coordinate, so for each such axis the earliest
    # round is the first r >= max(start, its round) on that axis.
    best = top
    for c, pr in rounds:
        for axis in range(grid.dims):
            if grid.line(axis, c) == grid.line(axis, coords):
                first = max(start, pr)
                best = min(best, first + (axis - first) % grid.dims)
    return best


def carried_weight(group_weight: float, members: int) -> float:
    """Mass carried into the next round of a multi-round call: the group's total weight split
    evenly, so the sum of weights (and the weighted mean) is conserved."""
    if members < 1:
        raise GridError("a group has at least one member")
    return group_weight / members
