"""bench.swarm's seeds: each cell the median and range over a system's runs, and the verdict
rule (a row wins only where its range clears the next one's), with the table that shows them."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.swarm import report
from bench.swarm.summary import seed_cells
from bench.swarm.verdict import MIN_RUNS, spread, verdict


def test_spread_is_median_and_range_and_drops_missing_runs() -> None:
    s = spread([2.5, 2.4, 2.9])
    assert s is not None and (s.median, s.low, s.high, s.runs) == (2.5, 2.4, 2.9, 3)
    assert s.text() == "2.500 [2.400, 2.900]"
    nan = spread([math.nan, 2.0])
    assert nan is not None and nan.runs == 1 and nan.text() == "2.000"
    assert spread([math.nan]) is None and spread([]) is None
    never = spread([None, 30.0, None])  # a loss not reached counts as worse than any time
    assert never is not None and math.isinf(never.median) and never.low == 30.0
    assert never.text(".0f") == "> budget [30, > budget]"


def test_a_clear_winner_and_an_overlap() -> None:
    clear = verdict({"ddp": [2.9, 2.95, 2.92], "diloco-int4": [2.40, 2.45, 2.41],
                     "moshpit": [2.6, 2.7, 2.65]})
    assert clear.winner == "diloco-int4"
    assert [r.system for r in clear.ranking] == ["diloco-int4", "moshpit", "ddp"]
    assert [r.clears_next for r in clear.ranking] == [True, True, None]
    assert "diloco-int4 wins on loss at end" in clear.text
    assert "2.410 [2.400, 2.450]" in clear.text and "moshpit's 2.650" in clear.text

    # the next row is cleared, but a wide range further down reaches up to the first's
    wide = verdict({"a": [1.0, 1.1], "b": [2.0, 2.0], "c": [1.05, 3.0]})
    assert [r.system for r in wide.ranking] == ["a", "b", "c"]
    assert wide.ranking[0].clears_next is True and wide.winner is None
    assert "a 1.050 [1.000, 1.100] clears b's 2.000 (x2) but not c's" in wide.text

    close = verdict({"a": [2.40, 2.50, 2.45], "b": [2.46, 2.48, 2.60]})
    assert close.winner is None and close.ranking[0].clears_next is False
    assert close.text.startswith("no row wins on loss at end: a 2.450")


def test_one_run_per_row_ranks_but_never_decides() -> None:
    one = verdict({"ddp": [2.2], "moshpit": [2.9]})
    assert one.winner is None and one.ranking[0].clears_next is None
    assert f"fewer than {MIN_RUNS} runs a row, so no verdict" in one.text
    assert verdict({"ddp": [2.2]}).text == "loss at end: only ddp has a value; no verdict"
    assert verdict({"ddp": [math.nan]}).text == "loss at end: no row has a value"
    # a row without a value ranks last and never wins
    assert [r.system for r in verdict({"x": [math.nan], "y": [3.0, 3.1]}).ranking] == ["y", "x"]


runs = st.lists(st.floats(min_value=0.5, max_value=6.0, allow_nan=False), min_size=1,
                max_size=4)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["ddp", "moshpit", "diloco-int4", "hivemind-local"]),
                       runs, min_size=1))
def test_the_winner_is_better_in_every_run_than_every_other_row(
        values: dict[str, list[float]]) -> None:
    v = verdict(values)
    if v.winner is not None:
        mine = values[v.winner]
        assert len(mine) >= MIN_RUNS
        for other, theirs in values.items():
            if other != v.winner:
                assert max(mine) < min(theirs)
    # the order of the input does not matter
    again = verdict(dict(reversed(list(values.items()))))
    assert (again.winner, again.text) == (v.winner, v.text)
    medians = [r.spread.median for r in v.ranking if r.spread is not None]
    assert medians == sorted(medians)


def _row(system: str, seed: int, loss: float, reached: float | None) -> dict[str, object]:
    return {"system": system, "seed": seed, "loss_end": loss, "time_to_ddp_end": reached,
            "goodput": 10.0 * (seed + 1), "bytes_total": 2e6, "cpu_busy": 0.5}


def test_seed_cells_and_their_table() -> None:
    rows = [_row(s, seed, loss + 0.01 * seed, t) for seed in range(3)
            for s, loss, t in (("ddp", 2.9, 120.0), ("diloco-int4", 2.4, 30.0),
                               ("hivemind-local", 3.3, None))]
    scen = seed_cells(rows)
    cells = scen["cells"]["diloco-int4"]
    assert cells["runs"] == 3 and cells["seeds"] == [0, 1, 2]
    assert cells["loss_end"] == {"median": pytest.approx(2.41), "low": 2.4,
                                 "high": pytest.approx(2.42), "runs": 3}
    assert scen["verdicts"]["loss_end"]["winner"] == "diloco-int4"
    assert scen["verdicts"]["time_to_ddp_end"]["winner"] == "diloco-int4"
    text = report.seeds_table(scen)
    lines = text.splitlines()
    assert lines[2].startswith("| diloco-int4 | 3 | 2.410 [2.400, 2.420] | 30 |")
    assert lines[2].endswith("| 2.0 | 0.50 | yes |")
    assert "| hivemind-local | 3 | 3.310 [3.300, 3.320] | not reached |" in text
    assert lines[-1].endswith("| - |")  # the last row has nothing to clear
