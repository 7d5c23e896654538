"""Subkey records: key -> {subkey: (value, version, deadline)}.

Matchmaking needs every peer's declaration under one key, so a key holds a dictionary. Each
subkey belongs to one writer (its peer id), which stamps every write with a version from its own
clock; replicas merge by the higher version, so a withdrawal (an empty value with a newer version)
beats an older declaration that arrives late. TTLs arrive as relative seconds and become local
monotonic deadlines: no clock sync between peers is needed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kademlia.storage import IStorage

MAX_TTL = 3600.0


@dataclass(frozen=True)
class StoredSub:
    value: bytes
    version: int
    deadline: float


class SubkeyStorage(IStorage):
    """Bounded store of subkey records; also satisfies kademlia's IStorage for plain keys."""

    def __init__(
        self,
        max_keys: int = 4096,
        max_subkeys: int = 256,
        max_value_bytes: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_keys = max_keys
        self.max_subkeys = max_subkeys
        self.max_value_bytes = max_value_bytes
        self.clock = clock
        self._subs: dict[bytes, dict[bytes, StoredSub]] = {}
        self._plain: dict[bytes, tuple[float, object]] = {}

    # --- subkey records -------------------------------------------------------------------
    def store_sub(self, key: bytes, subkey: bytes, value: bytes, version: int, ttl: float) -> bool:
        """Merge one record; returns False when it was refused or older than what we hold."""
        if len(value) > self.max_value_bytes or not ttl >= 0 or len(subkey) > 64:
            return False
        now = self.clock()
        self._expire(key, now)
        deadline = now + min(float(ttl), MAX_TTL)
        bucket = self._subs.get(key)
        if bucket is None:
            if len(self._subs) >= self.max_keys:
                self._expire_all(now)
                if len(self._subs) >= self.max_keys:
                    return False
            bucket = self._subs[key] = {}
        old = bucket.get(subkey)
        if old is not None and (old.version, old.deadline) >= (version, deadline):
            return False
        if old is None and len(bucket) >= self.max_subkeys:
            return False
        bucket[subkey] = StoredSub(value, version, deadline)
        return True

    def get_subs(self, key: bytes) -> dict[bytes, tuple[bytes, int, float]]:
        """Live records as subkey -> (value, version, remaining ttl), tombstones included."""
        now = self.clock()
        self._expire(key, now)
        bucket = self._subs.get(key, {})
        return {sk: (s.value, s.version, s.deadline - now) for sk, s in bucket.items()}

    def sub_keys(self) -> list[bytes]:
        return list(self._subs)

    def _expire(self, key: bytes, now: float) -> None:
        bucket = self._subs.get(key)
        if bucket is None:
            return
        for sk in [sk for sk, s in bucket.items() if s.deadline <= now]:
            del bucket[sk]
        if not bucket:
            del self._subs[key]

    def _expire_all(self, now: float) -> None:
        for key in list(self._subs):
            self._expire(key, now)

    # --- kademlia IStorage (plain values; kept bounded, used only by stock RPCs) ------------
    def __setitem__(self, key: bytes, value: object) -> None:
        if key not in self._plain and len(self._plain) >= self.max_keys:
            return
        self._plain[key] = (self.clock(), value)

    def __getitem__(self, key: bytes) -> object:
        return self._plain[key][1]

    def get(self, key: bytes, default: object = None) -> object:
        item = self._plain.get(key)
        return default if item is None else item[1]

    def iter_older_than(self, seconds_old: float) -> list[tuple[bytes, object]]:
        cutoff = self.clock() - seconds_old
        return [(k, v) for k, (t, v) in self._plain.items() if t < cutoff]

    def __iter__(self) -> Iterator[tuple[bytes, object]]:
        return iter([(k, v) for k, (_, v) in self._plain.items()])
