"""What a daemon's own rounds tell of its link: the rates it sends and receives at.

A round's wall time says little of one member's link: everyone waits for the slowest member,
so every member would learn the same rate, and spans sized from such rates would stay as they
were. Each data-plane connection instead times its own bytes, from the first to the last each
way. Connections to several peers run at once and share our link, so the sum of their rates is
what our side carried: a fast host's connection to another fast host is limited by our own
link, not by the slow peer it also talks to. Connections that moved little are mostly latency
and count for nothing.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterable

from moshpitd.transport.stats import Stats

MIN_TIMED_BYTES = 256 << 10  # a connection that moved less each way teaches no rate


def _rate(moved: int, first: float, last: float) -> float:
    """Bytes/s over one direction of a stream; 0 where it moved too little to teach one."""
    return moved / (last - first) if moved >= MIN_TIMED_BYTES and last > first else 0.0


def link_rates(channels: Iterable[Stats]) -> tuple[float, float]:
    """(send, receive) in bytes/s over this round's connections; 0 where none taught one."""
    up = down = 0.0
    for ch in channels:
        up += _rate(ch.bytes_out, ch.first_out, ch.last_out)
        down += stream_rate(ch)
    return up, down


# A follower's rate in a group we lead is at most this many times what its streams to us
# carried, times the streams its link carried at once (group size - 1): its own upload is
# shared by that many. Loose, since one stream's rate understates a link; tight enough that
# a declared 1e12 Mbit/s buys no more than a peer's measured rate would.
CAP_FACTOR = 2.0
CAP_WINDOW = 8  # a peer's last this many measurements; the highest counts
# A peer's stream bounds its link only when it ran below this share of the fastest stream into
# us in that round: one as fast as the others was held back by our own link (a slow leader
# would otherwise cap every fast follower at its own download)
BOTTLENECK = 0.5
MAX_PEERS = 4096  # peers whose rates we remember, the least recently measured dropped first


class PeerRates:
    """What each peer's streams to us carried lately (bytes/s), so that a leader caps the rate
    a follower declares (allreduce/group.py sizes spans from declared rates: a peer could
    otherwise take the largest span the share cap allows by declaring any rate)."""

    def __init__(self, max_peers: int = MAX_PEERS) -> None:
        self.max_peers = max_peers
        self._seen: OrderedDict[bytes, deque[float]] = OrderedDict()
        self.capped = 0  # declared rates a group we led lowered (for the metrics)

    def observe(self, peer_id: bytes, bytes_per_s: float) -> None:
        if not (bytes_per_s > 0 and math.isfinite(bytes_per_s)):
            return
        seen = self._seen.pop(peer_id, None) or deque(maxlen=CAP_WINDOW)
        seen.append(bytes_per_s)
        self._seen[peer_id] = seen
        while len(self._seen) > self.max_peers:
            self._seen.popitem(last=False)

    def cap_mbit(self, peer_id: bytes, group_size: int) -> float | None:
        """The highest rate (Mbit/s) we let `peer_id` declare in a group of that size, or None
        where we never timed its streams."""
        seen = self._seen.get(peer_id)
        if not seen:
            return None
        return CAP_FACTOR * max(group_size - 1, 1) * max(seen) * 8 / 1e6

    def capped_rate(self, peer_id: bytes, declared: float, group_size: int) -> float:
        cap = self.cap_mbit(peer_id, group_size)
        if cap is None or declared <= cap:
            return declared
        self.capped += 1
        return cap


def stream_rate(stats: Stats) -> float:
    """Bytes/s a peer's stream carried to us, 0 where it moved too little to teach one."""
    return _rate(stats.bytes_in, stats.first_in, stats.last_in)
