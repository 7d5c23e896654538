"""Which declared peers proved that they live: they answered our signed probe lately.

Identities cost nothing, so a key holder can declare hundreds of throw-away peers under a key
whose endpoints never answer (or answer as a tarpit). A matchmaker that followed or waited for
them would spend its attempt on them. Instead a peer counts, as a leader to follow, a peer to
wait for, and a record worth keeping when its key is full (dht/storage.py), only once it has
signed our nonce at its declared endpoint. Probes run in the background, a bounded number at a
time, so a flood of declarations costs at most that many calls in flight, never a wait in the
matchmaker's loop. An honest newcomer is proven one round trip after it is first seen.

Both maps are bounded and evict the oldest entry first: an attacker minting identities pushes
out its own earlier ones long before the few hundred honest peers a daemon matches with.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from moshpitd import timebase

if TYPE_CHECKING:
    from moshpitd.matchmaking.declaration import Candidate

log = logging.getLogger(__name__)

Probe = Callable[[str, bytes], Awaitable[bool]]  # (endpoint, peer id): did that peer answer

PROVEN_SECONDS = 600.0  # an answer vouches for a peer this long (it stays in the swarm)
FAILED_SECONDS = 10.0  # a peer that did not answer is not asked again for this long
CAPACITY = 4096  # peers remembered in each map
MAX_IN_FLIGHT = 16  # probes at once, over every key
PER_KEY = 8  # of which one key's requests may hold at most this many
# A proven peer this long outside our group gets asked again whether it lives: a live one has
# joined someone within a few polls of declaring; a killed one's declaration outlives it.
STRAGGLER_PROBE = 0.3  # s
# A partner of our last group that has not declared is asked this often whether it lives: a
# leader waits for it meanwhile (assembly.PARTNER_WAIT), so a killed one must cost little.
PARTNER_PROBE = 0.1  # s


class Liveness:
    def __init__(self, probe: Probe, proven_seconds: float = PROVEN_SECONDS,
                 failed_seconds: float = FAILED_SECONDS, capacity: int = CAPACITY,
                 max_in_flight: int = MAX_IN_FLIGHT,
                 clock: Callable[[], float] = timebase.monotonic) -> None:
        self.probe = probe
        self.proven_seconds, self.failed_seconds = proven_seconds, failed_seconds
        self.capacity, self.max_in_flight, self.clock = capacity, max_in_flight, clock
        self._proven: OrderedDict[bytes, float] = OrderedDict()  # peer -> until, oldest first
        self._failed: OrderedDict[bytes, float] = OrderedDict()
        self._in_flight: dict[bytes, tuple[str, asyncio.Task[None]]] = {}  # peer -> key, task
        self._listeners: set[Callable[[], None]] = set()
        self.probes = 0  # probes sent, for the metrics
        self.deferred = 0  # probes not sent because MAX_IN_FLIGHT (or PER_KEY) were out
        self.known: Callable[[bytes], bool] = lambda peer_id: False  # our DHT contacts

    def proven(self, peer_id: bytes) -> bool:
        return _live(self._proven, peer_id, self.clock())

    def failed(self, peer_id: bytes) -> bool:
        return _live(self._failed, peer_id, self.clock())

    def vouch(self, peer_id: bytes) -> None:
        """`peer_id` answered us some other way (a probe of a grid line-mate, say)."""
        _put(self._proven, peer_id, self.clock() + self.proven_seconds, self.capacity)
        self._failed.pop(peer_id, None)

    def unprove(self, peer_id: bytes) -> None:
        """`peer_id` let a round down (we excluded its part): probe it again before we count on
        it. A live peer answers at once; one that never sends data need not."""
        self._proven.pop(peer_id, None)

    def check(self, key: str, peers: Iterable[tuple[bytes, str]]) -> None:
        """Probe, in the background, each (peer id, endpoint) neither proven nor failed lately
        nor being probed: our DHT contacts first, then the others in random order (never by
        rank, which a declarer dates itself), while fewer than MAX_IN_FLIGHT are out, and
        PER_KEY for `key`, so a key flooded with throw-away identities starves no other."""
        todo = [(p, e) for p, e in peers if p not in self._in_flight
                and not self.proven(p) and not self.failed(p)]
        random.shuffle(todo)
        todo.sort(key=lambda pe: not self.known(pe[0]))
        mine = sum(1 for k, _ in self._in_flight.values() if k == key)
        for peer_id, endpoint in todo:
            if len(self._in_flight) >= self.max_in_flight or mine >= PER_KEY:
                self.deferred += 1
                return
            mine += 1
            self.probes += 1
            task = asyncio.ensure_future(self._probe(peer_id, endpoint))
            self._in_flight[peer_id] = (key, task)

    def listen(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Call `wake` each time a peer proves itself alive; returns what stops it. (Not on
        failures: a flood of tarpits would keep every matchmaker polling at its fastest.)"""
        self._listeners.add(wake)
        return lambda: self._listeners.discard(wake)

    async def ask(self, endpoint: str, peer_id: bytes) -> bool:
        """Probe now and remember the answer (a Probe itself: stragglers and grid line-mates
        are asked through it, so every answer counts everywhere)."""
        try:
            alive = await self.probe(endpoint, peer_id)
        except Exception as exc:  # a probe's own failure: the peer proved nothing
            log.debug("probe of %s at %s failed: %r", peer_id.hex()[:8], endpoint, exc)
            alive = False
        if not alive:
            self._proven.pop(peer_id, None)
            _put(self._failed, peer_id, self.clock() + self.failed_seconds, self.capacity)
            return False
        self.vouch(peer_id)
        for wake in list(self._listeners):
            wake()
        return True

    async def _probe(self, peer_id: bytes, endpoint: str) -> None:
        try:
            await self.ask(endpoint, peer_id)
        finally:
            self._in_flight.pop(peer_id, None)

    async def close(self) -> None:
        tasks = [task for _, task in self._in_flight.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _live(entries: OrderedDict[bytes, float], peer_id: bytes, now: float) -> bool:
    until = entries.get(peer_id)
    if until is None:
        return False
    if until > now:
        return True
    del entries[peer_id]
    return False


def _put(entries: OrderedDict[bytes, float], peer_id: bytes, until: float,
         capacity: int) -> None:
    entries.pop(peer_id, None)
    entries[peer_id] = until
    while len(entries) > capacity:
        entries.popitem(last=False)


class Vitals:
    """One request's view of its candidates' liveness: which it may follow or wait for, and
    which it found dead (`dead`, shared with its matchmaker)."""

    def __init__(self, key: str, dead: set[bytes], liveness: Liveness | None,
                 probe: Probe | None) -> None:
        self.key, self.dead, self.liveness, self.probe = key, dead, liveness, probe
        self._outside_since: dict[bytes, float] = {}
        self._partner_asked: dict[bytes, float] = {}  # -> when it may be asked again

    @contextlib.contextmanager
    def waking(self, wake: Callable[[], None]) -> Iterator[None]:
        """While the request runs, each probe's answer wakes its matchmaker."""
        if self.liveness is None:
            yield
            return
        stop = self.liveness.listen(wake)
        try:
            yield
        finally:
            stop()

    def proven(self, candidates: list[Candidate], followers: Collection[bytes]
               ) -> list[Candidate]:
        """The candidates we may follow or wait for: those that answered a probe lately (the
        others are probed in the background, earliest-ranked first, and count once they
        answer), our followers, and client-mode peers, which take no calls."""
        live = self.liveness
        if live is None:
            return candidates
        taken = [c for c in candidates if c.declaration.client_mode
                 or c.peer_id in followers or live.proven(c.peer_id)]
        if len(taken) < len(candidates):  # (a failed one is asked again once that is old)
            kept = {c.peer_id for c in taken}
            live.check(self.key, ((c.peer_id, c.declaration.endpoint) for c in candidates
                                  if c.peer_id not in kept and c.peer_id not in self.dead))
        return taken

    def asking_order(self, candidates: list[Candidate]) -> list[Candidate]:
        """Whom to ask to lead us first: our DHT contacts, then the others, each by rank. A
        leader that only declared itself (dated back to rank first, say) is asked after the
        peers we know from the DHT; we still ask only peers ranked before us, so no cycle."""
        known = self.liveness.known if self.liveness is not None else (lambda p: True)
        return sorted(candidates, key=lambda c: (not known(c.peer_id), c.rank))

    async def partners_coming(self, partners: Mapping[bytes, str], seen: Collection[bytes],
                              followers: Collection[bytes], now: float) -> frozenset[bytes]:
        """Our last group's partners (peer id -> endpoint; none in grid runs), if we have
        followers, that were never `seen` declared in this request, are not with us, and still
        answer: each is asked when first missed and every PARTNER_PROBE after; one that does
        not answer is dead for this request."""
        if self.probe is None or not partners or not followers:
            return frozenset()
        missing = [p for p in partners if p not in seen and p not in followers
                   and p not in self.dead]
        ask = [p for p in missing if now >= self._partner_asked.get(p, -math.inf)]
        for p in ask:
            self._partner_asked[p] = now + PARTNER_PROBE
        alive = await asyncio.gather(*(self.probe(partners[p], p) for p in ask))
        self.dead.update(p for p, ok in zip(ask, alive, strict=True) if not ok)
        return frozenset(p for p in missing if p not in self.dead)

    async def probe_stragglers(self, candidates: list[Candidate], followers: Collection[bytes],
                               now: float) -> None:
        """A killed daemon's declaration outlives it (until its TTL): a leader would wait for
        it until the deadline. Ask peers that stay outside once whether they live."""
        if self.probe is None:
            return
        ask = []
        for c in candidates:
            if (c.peer_id in followers or c.peer_id in self.dead
                    or c.declaration.client_mode):  # client-mode peers take no calls
                continue
            since = self._outside_since.setdefault(c.peer_id, now)
            if now - since >= STRAGGLER_PROBE:
                self._outside_since[c.peer_id] = math.inf  # once per request
                ask.append(c)
        if ask:
            alive = await asyncio.gather(*(self.probe(c.declaration.endpoint, c.peer_id)
                                           for c in ask))
            for c, ok in zip(ask, alive, strict=True):
                if not ok:
                    log.info("%s: declared peer %s does not answer: not waiting for it",
                             self.key, c.peer_id.hex()[:8])
                    self.dead.add(c.peer_id)
