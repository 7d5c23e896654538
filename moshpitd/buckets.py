"""Token buckets, and tables of them keyed by whoever is charged (an address, an identity),
bounded in size: what pacing per sender needs, wherever strangers may come from anywhere."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

K = TypeVar("K")
BUCKETS = 4096  # buckets a table keeps, the least recently used dropped past it


class Bucket:
    """A token bucket (of bytes, connections, records), on the clock it is given."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst, self.tokens, self.stamp = rate, burst, burst, now

    def charge(self, n: int, now: float) -> float:
        """Take n, into debt if need be; the seconds until it is out of debt (0: none)."""
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate) - n
        self.stamp = now
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate

    def take(self, n: int, now: float) -> bool:
        """Take n if there are n, else nothing."""
        if self.charge(n, now) > 0:
            self.tokens += n
            return False
        return True


def lru_bucket(table: OrderedDict[K, Bucket], key: K, new: Callable[[], Bucket],
               keep: int = BUCKETS) -> Bucket:
    """table[key], made by `new` if missing, now the most recently used; the least recently
    used dropped past `keep`. (A sender that is dropped comes back with a full bucket: `keep`
    is sized so that only a flood of senders, each paced on its own, cycles through it.)"""
    bucket = table.pop(key, None)
    if bucket is None:
        bucket = new()
        if len(table) >= keep:
            table.popitem(last=False)
    table[key] = bucket
    return bucket
