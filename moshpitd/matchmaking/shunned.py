"""Leaders a daemon no longer asks for a while: those that accepted us and never assembled.
Remembered past the request that met them, so one identity stalls a daemon's rounds once, not
every round; bounded, since identities are free (the oldest is forgotten first). Not for
long: an honest leader can stall once in a cycle of inconsistent views, and a daemon that
shuns it forms smaller groups meanwhile."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from moshpitd import timebase

SHUN_SECONDS = 120.0
LIAR_SECONDS = 30 * 86400.0  # an owner caught lying: for as long as a daemon runs, in practice
CAPACITY = 4096


class Shunned:
    def __init__(self, seconds: float = SHUN_SECONDS, capacity: int = CAPACITY,
                 clock: Callable[[], float] = timebase.monotonic) -> None:
        self.seconds, self.capacity, self.clock = seconds, capacity, clock
        self._until: OrderedDict[bytes, float] = OrderedDict()  # by when we shunned them

    def add(self, peer_id: bytes) -> bytes:
        """Shuns `peer_id` from now on; returns it."""
        self._until.pop(peer_id, None)
        self._until[peer_id] = self.clock() + self.seconds
        while len(self._until) > self.capacity:
            self._until.popitem(last=False)
        return peer_id

    def current(self) -> set[bytes]:
        """The peer ids shunned now (a copy: a request adds its own dead peers to it)."""
        now = self.clock()
        while self._until and next(iter(self._until.values())) <= now:
            self._until.popitem(last=False)
        return set(self._until)

    def __contains__(self, peer_id: bytes) -> bool:
        until = self._until.get(peer_id)
        return until is not None and until > self.clock()

    def __len__(self) -> int:
        return len(self._until)
