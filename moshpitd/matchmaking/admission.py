"""How many Join calls a daemon holds at once. A leader keeps each follower's call open until
its group assembles, and checks each joiner against the DHT: peer ids cost nothing, so the calls
are bounded per asking peer id and in total, and one past a bound is refused at once.

A join takes a slot only once its signature proves the peer id it claims (a join claiming a
victim's id cannot use up the victim's share), and a slot lasts at most its leader's attempt
plus a margin: a caller that stops reading (an HTTP/2 window of 0) can stall the handler's
write, but not keep the slot, which is counted free once its deadline passes whatever the
transport does."""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable

from moshpitd import timebase

IN_FLIGHT = "in_flight"  # the `limit` label of moshpitd_joins_refused_total
PER_PEER = "per_peer"
# s past a leader's attempt that a follower's slot may last: the GroupInfo's write
SLOT_MARGIN = 5.0


class JoinAdmission:
    def __init__(self, total: int, per_peer: int,
                 clock: Callable[[], float] = timebase.monotonic) -> None:
        self.total = total
        self.per_peer = per_peer
        self.clock = clock
        self._slots: dict[int, tuple[bytes, float]] = {}  # slot -> (peer id, until)
        self._by_deadline: list[tuple[float, int]] = []
        self._held: Counter[bytes] = Counter()
        self._ids = itertools.count()
        self.refused: Counter[str] = Counter()
        self.expired = 0  # slots freed by their deadline, not by their call

    @property
    def held(self) -> int:
        self._expire()
        return len(self._slots)

    def admit(self, peer_id: bytes, seconds: float) -> int | str:
        """A slot (an int) held until `release` or `seconds` from now; else why it is
        refused (a str)."""
        self._expire()
        if self._held[peer_id] >= self.per_peer:
            self.refused[PER_PEER] += 1
            return (f"this peer already has {self.per_peer} join(s) in flight here "
                    "(setting join_max_per_peer)")
        if len(self._slots) >= self.total:
            self.refused[IN_FLIGHT] += 1
            return f"{self.total} joins are in flight here (setting join_max_in_flight)"
        slot = next(self._ids)
        until = self.clock() + max(seconds, 0.0) + SLOT_MARGIN
        self._slots[slot] = (peer_id, until)
        heapq.heappush(self._by_deadline, (until, slot))
        self._held[peer_id] += 1
        return slot

    def release(self, slot: int) -> None:
        entry = self._slots.pop(slot, None)
        if entry is not None:
            self._drop(entry[0])

    def _drop(self, peer_id: bytes) -> None:
        self._held[peer_id] -= 1
        if self._held[peer_id] <= 0:
            del self._held[peer_id]

    def _expire(self) -> None:
        now = self.clock()
        while self._by_deadline and self._by_deadline[0][0] <= now:
            _, slot = heapq.heappop(self._by_deadline)
            entry = self._slots.pop(slot, None)
            if entry is not None:
                self.expired += 1
                self._drop(entry[0])
