"""plan_round: the round a peer averages in next, caught up without knocking the grid out of
phase, and found without walking towards a round number a peer supplied."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from moshpitd.matchmaking.grid import Grid, plan_round


def test_plan_round_waits_for_line_mates_still_in_the_round() -> None:
    grid = Grid(4, 2)
    me = (0, 0)
    # round 0 averages along axis 0: line-mates share coordinate 1 (here 0)
    peers = [((1, 0), 0), ((2, 0), 1), ((0, 3), 1)]
    assert plan_round(grid, 0, me, peers) == 0  # (1, 0) has not done round 0 yet
    peers = [((1, 0), 1), ((2, 0), 1), ((0, 3), 1)]
    assert plan_round(grid, 0, me, peers) == 1  # my line did round 0 without me


def test_plan_round_joiner_jumps_to_the_swarm_and_never_beyond() -> None:
    grid = Grid(2, 2)
    peers = [((0, 1), 57), ((1, 0), 57), ((1, 1), 57)]
    assert plan_round(grid, 0, (0, 0), peers) == 57
    assert plan_round(grid, 60, (0, 0), peers) == 60  # never backwards
    assert plan_round(grid, 3, (0, 0), []) == 3


@settings(max_examples=300, deadline=None)
@given(m=st.integers(2, 4), d=st.integers(1, 3), own=st.integers(0, 8),
       data=st.data())
def test_plan_round_properties(m: int, d: int, own: int, data: st.DataObject) -> None:
    grid = Grid(m, d)
    cells = st.tuples(*[st.integers(0, m - 1)] * d)
    me = data.draw(cells)
    peers = data.draw(st.lists(st.tuples(cells, st.integers(0, 10)), max_size=12))
    r = plan_round(grid, own, me, peers)
    assert r >= own
    if peers:
        assert r >= min(pr for _, pr in peers)
        assert r <= max(own, max(pr for _, pr in peers))
        # at the chosen round, unless everyone is past it, some line-mate is still there
        mates = [pr for c, pr in peers if grid.line(r, c) == grid.line(r, me)]
        if r < max(pr for _, pr in peers) and r > own:
            assert mates and not all(pr > r for pr in mates)


def _plan_round_by_walking(grid: Grid, own_round: int, coords: tuple[int, ...],
                           peers: list[tuple[tuple[int, ...], int]]) -> int:
    """The rule as first written, a round at a time: the reference for small numbers."""
    if not peers:
        return own_round
    r = max(own_round, min(pr for _, pr in peers))
    top = max(pr for _, pr in peers)
    while r < top:
        line = grid.line(r, coords)
        mates = [pr for c, pr in peers if grid.line(r, c) == line]
        if mates and not all(pr > r for pr in mates):
            break
        r += 1
    return r


@settings(max_examples=400, deadline=None)
@given(st.integers(1, 4), st.integers(2, 3), st.integers(0, 40), st.data())
def test_plan_round_agrees_with_the_walk(dims: int, size: int, own: int,
                                         data: st.DataObject) -> None:
    grid = Grid(size, dims)
    cell = st.tuples(*[st.integers(0, size - 1)] * dims)
    me = data.draw(cell)
    peers = data.draw(st.lists(st.tuples(cell, st.integers(0, 60)), max_size=8))
    assert plan_round(grid, own, me, peers) == _plan_round_by_walking(grid, own, me, peers)


def test_plan_round_never_walks_towards_a_peer_supplied_round() -> None:
    """Two records (one at round 0 off our lines, one at 2^61 on them) once made the
    planner count to 2^61 on the event loop: now it answers at once."""
    grid = Grid(4, 2)
    assert plan_round(grid, 0, (0, 0), [((1, 1), 0), ((0, 0), 1 << 61)]) == 1 << 61
    assert plan_round(grid, 0, (0, 0), [((1, 1), 0), ((0, 1), 1 << 61)]) == 1 << 61
