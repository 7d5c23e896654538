"""The run directory believes no record far ahead of the run: rounds come from peers."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from moshpitd.matchmaking.grid import Grid
from moshpitd.matchmaking.runs import MAX_ROUND_LEAD, PeerEntry, RunDirectory

GRID = Grid(4, 2)


@dataclass
class Record:
    value: bytes


class Directory:
    """get_subs of a DHT that holds the given entries."""

    def __init__(self, entries: dict[bytes, PeerEntry]) -> None:
        self.entries = entries

    async def get_subs(self, key: str, max_ttl: float = 0.0) -> dict[bytes, Any]:
        return {pid: Record(e.pack()) for pid, e in self.entries.items()}

    async def store_sub(self, key: str, subkey: bytes, value: bytes, ttl: float) -> int:
        return 2

    def peer_count(self) -> int:
        return 1


def directory(entries: dict[bytes, PeerEntry]) -> RunDirectory:
    run = RunDirectory(Directory(entries), b"me" * 10, "run", GRID)  # type: ignore[arg-type]
    run.coords = (0, 0)
    return run


def plan(entries: dict[bytes, PeerEntry]) -> int:
    return asyncio.run(directory(entries).plan(None)).round


def believed(entries: dict[bytes, PeerEntry]) -> set[bytes]:
    return set(asyncio.run(directory(entries).peers()))


def test_a_record_far_ahead_of_the_run_is_not_followed() -> None:
    attack = {b"a" * 20: PeerEntry(GRID, (1, 1), 0),
              b"b" * 20: PeerEntry(GRID, (2, 2), 1 << 61, joining=True)}
    assert plan(attack) == 0
    honest = {b"h%019d" % i: PeerEntry(GRID, (0, i), 500) for i in range(1, 3)}
    assert plan({**attack, **honest}) == 500  # a latecomer still catches up to the run
    near = {b"c" * 20: PeerEntry(GRID, (0, 1), 500 + MAX_ROUND_LEAD, joining=True)}
    assert believed({**honest, **near, **attack}) == {*honest, *near, b"a" * 20}


def test_an_entry_that_names_no_daemon_is_not_waited_for() -> None:
    """A "joining" entry without an endpoint cannot be probed: once, grid rounds waited for it
    (0.95 s became 9.7 s). With an endpoint it is probed and, alive, waited for."""
    entries = {b"n" * 20: PeerEntry(GRID, (3, 3), 0, joining=True),
               b"e" * 20: PeerEntry(GRID, (3, 3), 0, joining=True, endpoint="127.0.0.1:1")}
    probed: list[str] = []

    async def probe(endpoint: str, peer_id: bytes) -> bool:
        probed.append(endpoint)
        return True

    run = directory(entries)
    run.probe = probe

    async def go() -> frozenset[bytes]:
        await run.plan((0, 0))
        return (await run.watcher(run.round)()).expected
    assert asyncio.run(go()) == {b"e" * 20}
    assert probed == ["127.0.0.1:1"]
