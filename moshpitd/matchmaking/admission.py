"""How many Join calls a daemon holds at once. A leader keeps each follower's call open until
its group assembles, and checks each joiner against the DHT: peer ids cost nothing, so the calls
are bounded per asking peer id and in total, and one past a bound is refused at once."""

from __future__ import annotations

from collections import Counter

IN_FLIGHT = "in_flight"  # the `limit` label of moshpitd_joins_refused_total
PER_PEER = "per_peer"


class JoinAdmission:
    def __init__(self, total: int, per_peer: int) -> None:
        self.total = total
        self.per_peer = per_peer
        self._held: Counter[bytes] = Counter()
        self.refused: Counter[str] = Counter()

    @property
    def held(self) -> int:
        return sum(self._held.values())

    def admit(self, peer_id: bytes) -> str | None:
        """None, and the call is held until `release`; else why it is refused."""
        if self._held[peer_id] >= self.per_peer:
            self.refused[PER_PEER] += 1
            return (f"this peer already has {self.per_peer} join(s) in flight here "
                    "(setting join_max_per_peer)")
        if self.held >= self.total:
            self.refused[IN_FLIGHT] += 1
            return f"{self.total} joins are in flight here (setting join_max_in_flight)"
        self._held[peer_id] += 1
        return None

    def release(self, peer_id: bytes) -> None:
        self._held[peer_id] -= 1
        if self._held[peer_id] <= 0:
            del self._held[peer_id]
