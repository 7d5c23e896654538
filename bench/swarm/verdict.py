"""Several runs (seeds) of the same rows: each cell the median with its range, and a verdict.

The rule (docs/results.md, "The rerun's setup"): rows are ranked by the median of a metric
where lower is better (loss at end; seconds to a loss); a row's range *clears* the next
one's where its worst run is better than the next row's best run, each with at least
MIN_RUNS runs. The scenario's verdict names the first row if its range clears that of every
other row (the next one's, and any wider range below it that reaches up to it); otherwise
no row wins. With one run per row there is a ranking, never a verdict: one run cannot tell a
difference from the noise between runs.

Values that are NaN (a run that produced none) are left out; None or +inf (a loss never
reached) count as worse than every finite value.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MIN_RUNS = 2


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float
    runs: int

    def text(self, spec: str = ".3f", unit: str = "") -> str:
        def one(x: float) -> str:
            return "> budget" if math.isinf(x) else f"{format(x, spec)}{unit}"
        if self.runs == 1 or self.low == self.high:
            return one(self.median) + ("" if self.runs == 1 else f" (x{self.runs})")
        return f"{one(self.median)} [{one(self.low)}, {one(self.high)}]"


def spread(values: Sequence[float | None]) -> Spread | None:
    """Median and range of the runs' values; None if no run has one."""
    kept = [math.inf if v is None else float(v) for v in values]
    kept = [v for v in kept if not math.isnan(v)]
    if not kept:
        return None
    return Spread(statistics.median(kept), min(kept), max(kept), len(kept))


@dataclass(frozen=True)
class Ranked:
    system: str
    spread: Spread | None
    clears_next: bool | None  # None: the last row, or too few runs to tell

    def mark(self) -> str:
        return {True: "yes", False: "no", None: "-"}[self.clears_next]


@dataclass(frozen=True)
class Verdict:
    metric: str
    ranking: tuple[Ranked, ...]
    winner: str | None
    text: str


def _clears(a: Spread | None, b: Spread | None) -> bool | None:
    if a is None or b is None or a.runs < MIN_RUNS or b.runs < MIN_RUNS:
        return None
    return a.high < b.low


def _rank_key(item: tuple[str, Spread | None]) -> tuple[int, float, float, str]:
    """By median, then by the worst run; rows without a value last; ties by name."""
    system, s = item
    return (1, 0.0, 0.0, system) if s is None else (0, s.median, s.high, system)


def verdict(values: Mapping[str, Sequence[float | None]], metric: str = "loss at end",
            spec: str = ".3f") -> Verdict:
    """Ranks the rows of `values` (system -> one value per run, lower is better)."""
    spreads = {system: spread(v) for system, v in values.items()}
    order = [system for system, _ in sorted(spreads.items(), key=_rank_key)]
    ranking = tuple(
        Ranked(s, spreads[s], _clears(spreads[s], spreads[order[i + 1]])
               if i + 1 < len(order) else None)
        for i, s in enumerate(order))
    return Verdict(metric, ranking, *_say(metric, ranking, spec))


def _say(metric: str, ranking: tuple[Ranked, ...], spec: str) -> tuple[str | None, str]:
    if not ranking or ranking[0].spread is None:
        return None, f"{metric}: no row has a value"
    first = ranking[0]
    assert first.spread is not None
    if len(ranking) == 1 or ranking[1].spread is None:
        return None, f"{metric}: only {first.system} has a value; no verdict"
    second = ranking[1]
    assert second.spread is not None
    a, b = first.spread, second.spread

    def rng(s: Spread) -> str:
        return s.text(spec)
    if first.clears_next is None:
        return None, (f"{metric}: {first.system} lowest ({rng(a)}), {second.system} next "
                      f"({rng(b)}); fewer than {MIN_RUNS} runs a row, so no verdict")
    if not first.clears_next:
        return None, (f"no row wins on {metric}: {first.system} {rng(a)} and {second.system} "
                      f"{rng(b)} overlap")
    for other in ranking[2:]:  # a wide range further down can reach up to the first row's
        if other.spread is not None and _clears(a, other.spread) is not True:
            return None, (f"no row wins on {metric}: {first.system} {rng(a)} clears "
                          f"{second.system}'s {rng(b)} but not {other.system}'s "
                          f"{rng(other.spread)}")
    return first.system, (f"{first.system} wins on {metric}: its range {rng(a)} clears "
                          f"{second.system}'s {rng(b)} and every other row's")
