"""What a daemon knows and declares about one run on the Moshpit grid.

Every peer of a run keeps one record (subkey = peer id) under the key of each of its lines,
`{run}/line/{axis}/{the other coordinates}`: its grid, its fixed cell and the round it is about
to average in. Those records serve three purposes: a joining peer picks an empty cell from the
lines it reads, a late peer catches up to its line-mates' round, and a peer learns which
line-mates to expect in its group (so a full line assembles at once, and a peer alone on its
line keeps its value without waiting for nobody).

One key per line, not one for the run: a round needs only the peers of one line (M of them), and
a single key holding every peer was read whole at every matchmaking poll, by every peer, with
each of its records' signatures checked once per new version: N^2 checks a round, 1M at 1,024
peers, and more records than one DHT key holds (dht_max_records_per_key). docs/scale.md has the
numbers.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import msgpack

from moshpitd import timebase
from moshpitd.dht.network import DHTNode
from moshpitd.matchmaking.errors import MatchmakingError
from moshpitd.matchmaking.grid import Coords, Grid, choose_coords, plan_round
from moshpitd.matchmaking.matchmaker import LineStatus, LineWatcher
from moshpitd.matchmaking.request import LONELY_GRACE

# Protocol constants. A run directory outlives its rounds and the requests that drive it (each
# with its own timeout), so none of these can come from one round's clock.
# A peer's record lives this long unless refreshed (every round refreshes it): a peer that
# vanished without withdrawing drops out of the directory within a minute.
ENTRY_TTL = 60.0  # s
# Joining a run: read the directory every SETTLE_INTERVAL (a DHT read and a store take a few ms)
# until two reads in a row agree, at most SETTLE_READS times; peers that picked the same cell
# move at most MAX_MOVES times (a count, not a time).
SETTLE_READS = 6
SETTLE_INTERVAL = 0.03  # s
MAX_MOVES = 8
# A line-mate whose daemon did not answer a probe is not waited for this long: a killed peer's
# record outlives it by up to ENTRY_TTL, but a daemon that was only briefly unreachable is
# waited for again after half of that.
DEAD_FOR = ENTRY_TTL / 2
# A run whose membership changed this recently may have more to come: its list of expected
# line-mates is not complete yet (peers joining together register within a few polls).
SETTLE_SECONDS = 0.3  # s
# LONELY_GRACE in this daemon's first round of the run: line-mates started at the same moment
# may still be starting (bootstrapping the DHT, choosing a cell) and not have declared yet.
FIRST_GRACE = 1.0  # s

# A record whose round is further than this ahead of the run's (the lower median of the other
# peers' rounds) is not believed: one identity's record at round 2^61 would otherwise carry its
# line-mates there, and every honest peer after them. Honest peers of a run sit within a few
# rounds of each other; one that joins late catches up to the median, which liars in a
# minority cannot move.
MAX_ROUND_LEAD = 64

# Our own entry, unchanged, is not stored again before this: a round's end already stored the
# round the next plan declares, and the entry lives ENTRY_TTL.
REFRESH_AFTER = ENTRY_TTL / 3
# A joining peer without initial_coords reads this many lines of axis 0 (all of them on a grid
# with fewer) to find an empty cell: M cells each, so at most M * JOIN_LINES entries. Each of
# its settle and move reads reads them all: at 16, eight joiners under churn sent 12,000
# record reads in one round of a 64-peer swarm (docs/scale.md).
JOIN_LINES = 4
Probe = Callable[[str, bytes], Awaitable[bool]]

log = logging.getLogger(__name__)


class GridMismatch(MatchmakingError):
    """Peers of the run use another grid."""


@dataclass(frozen=True)
class PeerEntry:
    grid: Grid
    coords: Coords
    round: int
    joining: bool = False  # still choosing its cell: it may land on any line
    endpoint: str = ""  # its gRPC address, to tell a dead line-mate from a slow one

    def pack(self) -> bytes:
        return bytes(msgpack.packb([1, self.grid.size, self.grid.dims, list(self.coords),
                                    self.round, self.joining, self.endpoint]))

    @classmethod
    def unpack(cls, raw: bytes) -> PeerEntry | None:
        try:
            obj = msgpack.unpackb(raw)
            if not (isinstance(obj, list) and len(obj) == 7 and obj[0] == 1
                    and isinstance(obj[4], int) and 0 <= obj[4] < 1 << 62
                    and isinstance(obj[3], list) and isinstance(obj[5], bool)
                    and isinstance(obj[6], str) and len(obj[6]) <= 256):
                return None
            grid = Grid(obj[1], obj[2])
            return cls(grid, grid.check(obj[3]), obj[4], obj[5], obj[6])
        except Exception:  # untrusted bytes: anything malformed is simply not an entry
            return None


@dataclass(frozen=True)
class RoundPlan:
    round: int
    key: str
    expected: frozenset[bytes]  # line-mates that will come to this round's group


class RunDirectory:
    def __init__(self, dht: DHTNode, peer_id: bytes, run: str, grid: Grid,
                 endpoint: str = "", probe: Probe | None = None,
                 rng: random.Random | None = None) -> None:
        self.dht = dht
        self.endpoint = endpoint
        self.probe = probe
        self._dead: dict[bytes, float] = {}  # peer id -> until when we believe it dead
        self._members: frozenset[bytes] = frozenset()
        self._changed_at = timebase.monotonic()
        self.peer_id = peer_id
        self.run = run
        self.grid = grid
        self.rng = rng or random.Random()
        self.coords: Coords | None = None
        self.round = 0
        self.rounds_done = 0
        self._stored: tuple[PeerEntry, float] | None = None  # our entry and when it was stored
        self._storing: asyncio.Future[None] | None = None  # a round's end, stored meanwhile
        self._planned: tuple[int, dict[bytes, PeerEntry]] | None = None  # the plan's read
        self._lines_stored: frozenset[str] = frozenset()  # where our entry is
        self._grid_stored = -math.inf  # when our entry was last stored under grid_key
        self._mates_behind = False  # the planned round's line-mates were at earlier rounds
        rows = grid.size ** (grid.dims - 1)  # lines of axis 0
        picks = [_unrank(i, grid.size, grid.dims - 1)
                 for i in self.rng.sample(range(rows), min(rows, JOIN_LINES))]
        self._join_lines = [self.line_key(0, (0, *others)) for others in picks]
        self._join_cells = [(x, *others) for others in picks for x in range(grid.size)]

    @property
    def grid_key(self) -> str:
        """Where every peer of the run also keeps its entry, refreshed only as its lifetime
        needs: a joiner reads it once, to learn whether the run's peers use another grid."""
        return f"{self.run}/grid"

    def line_key(self, axis: int, coords: Coords) -> str:
        return line_key(self.run, axis, coords)

    def lines(self) -> list[str]:
        """The keys of every line through our cell."""
        assert self.coords is not None
        return [self.line_key(axis, self.coords) for axis in range(self.grid.dims)]

    async def peers(self, keys: Sequence[str] | None = None) -> dict[bytes, PeerEntry]:
        """The entries under `keys` (by default our lines, or, before we have a cell, the lines
        a joiner reads)."""
        if keys is None:
            keys = self.lines() if self.coords is not None else self._join_lines
        reads = await asyncio.gather(*(self.dht.get_subs(k, max_ttl=ENTRY_TTL) for k in keys))
        out: dict[bytes, PeerEntry] = {}
        others: Counter[Grid] = Counter()
        for pid, rec in (item for read in reads for item in read.items()):
            if pid == self.peer_id:
                continue
            entry = PeerEntry.unpack(rec.value)
            if entry is None:
                continue
            if entry.grid != self.grid:
                others[entry.grid] += 1
                continue
            if pid not in out or out[pid].round < entry.round:  # each line has its copy
                out[pid] = entry
        if out:
            rounds = sorted(e.round for e in out.values())
            limit = rounds[(len(rounds) - 1) // 2] + MAX_ROUND_LEAD
            ahead = [pid for pid, e in out.items() if e.round > limit]
            for pid in ahead:
                log.debug("%s: ignoring %s's entry at round %d (the run is near %d)",
                          self.run, pid.hex()[:12], out[pid].round, limit - MAX_ROUND_LEAD)
                del out[pid]
        members = frozenset(out)
        if members != self._members:
            self._members, self._changed_at = members, timebase.monotonic()
        if others and not out:
            grid, count = others.most_common(1)[0]
            raise GridMismatch(
                f"run {self.run!r}: {count} peer(s) use grid {grid.size}^{grid.dims}, this "
                f"request asked for {self.grid.size}^{self.grid.dims}"
            )
        return out

    async def plan(self, initial_coords: Sequence[int] | None) -> RoundPlan:
        """Choose our cell (first time only), catch up to the swarm's round, declare it."""
        if self.coords is None:
            await self.peers([self.grid_key])  # refused if the run's peers use another grid
            await self._take_cell({} if initial_coords is not None
                                  else await self.peers(self._join_lines), initial_coords)
        peers = await self.peers()
        if initial_coords is not None and tuple(initial_coords) != self.coords:
            raise MatchmakingError(
                f"run {self.run!r}: this daemon already sits at {self.coords}; coordinates are "
                "fixed for a run"
            )
        assert self.coords is not None
        # a peer still choosing its cell may land on our line: count it as a line-mate
        self.round = plan_round(self.grid, self.round, self.coords,
                                [(self.coords if e.joining else e.coords, e.round)
                                 for e in peers.values()])
        line = self.grid.line(self.round, self.coords)
        self._mates_behind = any(not e.joining and e.round < self.round
                                 and self.grid.line(self.round, e.coords) == line
                                 for e in peers.values())
        await self.declare()
        self._planned = (self.round, peers)
        return RoundPlan(self.round, self.grid.group_key(self.run, self.round, self.coords),
                         self._line_status(peers, self.round).expected)

    def _line_status(self, peers: dict[bytes, PeerEntry], round_: int) -> LineStatus:
        assert self.coords is not None
        line = self.grid.line(round_, self.coords)
        expected = frozenset(
            pid for pid, e in peers.items()
            if e.joining or (self.grid.line(round_, e.coords) == line and e.round <= round_)
        )
        return LineStatus(expected, any(e.round > round_ for e in peers.values()))

    def watcher(self, round_: int) -> LineWatcher:
        """For the matchmaker: who is still coming to this round, re-read at every poll.
        Line-mates are probed once per round; a dead one (killed, its record not yet expired)
        is not waited for."""
        probed: set[bytes] = set()
        # the first poll takes the plan's read, made moments before for this very round
        first = self._planned[1] if self._planned and self._planned[0] == round_ else None
        self._planned = None

        assert self.coords is not None
        line = [self.line_key(self.grid.axis(round_), self.coords)]

        async def watch() -> LineStatus:
            nonlocal first
            peers, first = (first, None) if first is not None else (await self.peers(line),
                                                                     None)
            status = self._line_status(peers, round_)
            now = timebase.monotonic()
            fresh = [p for p in status.expected if p not in probed and peers[p].endpoint]
            if self.probe is not None and fresh:
                probed.update(fresh)
                alive = await asyncio.gather(*(self.probe(peers[p].endpoint, p) for p in fresh))
                for pid, ok in zip(fresh, alive, strict=True):
                    if not ok:
                        self._dead[pid] = now + DEAD_FOR
            dead = {p for p, until in self._dead.items() if until > now}
            if self.probe is not None:  # an entry that names no daemon cannot prove it lives
                dead |= {p for p in status.expected if not peers[p].endpoint}
            settled = now - self._changed_at >= SETTLE_SECONDS
            grace = FIRST_GRACE if self.rounds_done == 0 else LONELY_GRACE
            return LineStatus(status.expected - dead, status.moved_on, settled, grace)
        return watch

    async def _take_cell(self, peers: dict[bytes, PeerEntry],
                         initial_coords: Sequence[int] | None) -> dict[bytes, PeerEntry]:
        """Pick the emptiest cell. Peers joining together may pick the same one: the one with
        the higher peer id moves while an emptier cell exists, so a swarm started at once still
        fills the grid."""
        if initial_coords is not None:  # a fixed cell: declare it at once, line-mates wait
            self.coords = choose_coords(self.grid, Counter(), self.rng, initial_coords)
            return peers
        peers = await self._settle(peers)
        self.coords = choose_coords(self.grid, Counter(e.coords for e in peers.values()),
                                    self.rng, cells=self._join_cells)
        for _ in range(MAX_MOVES):
            await self.declare(joining=True)
            await asyncio.sleep(SETTLE_INTERVAL)
            peers = await self.peers(self._join_lines)
            occupancy = Counter(e.coords for e in peers.values())
            rivals = [pid for pid, e in peers.items() if e.coords == self.coords]
            least = min(occupancy.get(c, 0) for c in self._join_cells)
            if not rivals or min(rivals) > self.peer_id or occupancy[self.coords] <= least:
                break
            self.coords = choose_coords(self.grid, occupancy, self.rng,
                                        cells=self._join_cells)
        return peers

    async def _settle(self, peers: dict[bytes, PeerEntry]) -> dict[bytes, PeerEntry]:
        """On joining a run, peers starting together register at once: wait until the
        directory stops growing (a few tens of ms) before picking a cell."""
        stable = 0
        for _ in range(SETTLE_READS):
            await asyncio.sleep(SETTLE_INTERVAL)
            again = await self.peers(self._join_lines)
            stable = stable + 1 if set(again) == set(peers) else 0
            peers = again
            if stable >= 2:
                break
        return peers

    async def declare(self, joining: bool = False) -> None:
        await self._stored_meanwhile()
        await self._store(joining)

    async def _stored_meanwhile(self) -> None:
        if self._storing is not None:
            await asyncio.shield(self._storing)

    async def _store(self, joining: bool = False) -> None:
        """Store our entry, unless the same one was stored lately and reached another node."""
        assert self.coords is not None
        entry = PeerEntry(self.grid, self.coords, self.round, joining, self.endpoint)
        now = timebase.monotonic()
        if self._stored is not None and self._stored[0] == entry \
                and now - self._stored[1] < REFRESH_AFTER:
            return
        keys = frozenset(self.lines())
        moved, self._lines_stored = self._lines_stored - keys, keys
        if now - self._grid_stored >= REFRESH_AFTER:
            self._grid_stored = now
            keys |= {self.grid_key}
        if moved:  # a joiner that changed cells: line-mates of its old one must not wait for it
            await asyncio.gather(*(self.dht.withdraw_sub(k, self.peer_id) for k in moved),
                                 return_exceptions=True)
        copies = await asyncio.gather(*(self.dht.store_sub(k, self.peer_id, entry.pack(),
                                                           ENTRY_TTL) for k in sorted(keys)))
        stored = min(copies) > 1 or self.dht.peer_count() == 0
        self._stored = (entry, now) if stored else None

    async def finish(self, round_: int, met: bool = True) -> None:
        """Members leave a round at r + 1, whatever became of it, with one exception. A
        joiner's first round whose line-mates never came (`met` False: matchmaking failed)
        while they were still at an earlier round is kept, and the next plan asks for it
        again (plan_round moves on if they have). A peer that joined one round late, past
        line-mates that had finished it, otherwise stayed one round ahead of them for good:
        each of its rounds came before theirs. Later rounds move on, so line-mates that sit
        out cost one round, not every one. Stored in the background: the trainer need not
        wait a round trip for it; the next plan or leave waits for it."""
        held = not met and self._mates_behind and self.rounds_done == 0
        self.round = max(self.round, round_ if held else round_ + 1)
        self.rounds_done += 1
        await self._stored_meanwhile()
        self._storing = asyncio.ensure_future(self._declare_quietly())

    async def _declare_quietly(self) -> None:
        try:
            await self._store()
        except Exception as exc:  # the entry expires by itself; the next round stores it
            log.debug("%s: storing our entry failed: %r", self.run, exc)
        finally:
            self._storing = None

    async def leave(self) -> None:
        await self._stored_meanwhile()
        self._stored = None
        keys, self._lines_stored = self._lines_stored | {self.grid_key}, frozenset()
        await asyncio.gather(*(self.dht.withdraw_sub(k, self.peer_id) for k in sorted(keys)))


def line_key(run: str, axis: int, coords: Sequence[int]) -> str:
    """The DHT key of the line through `coords` along `axis`."""
    others = ".".join(str(c) for i, c in enumerate(coords) if i != axis)
    return f"{run}/line/{axis}/{others}"


def _unrank(i: int, size: int, n: int) -> tuple[int, ...]:
    out = []
    for _ in range(n):
        i, c = divmod(i, size)
        out.append(c)
    return tuple(reversed(out))
