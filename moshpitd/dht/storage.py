"""Subkey records: key -> {subkey: (value, version, deadline, proof)}.

Matchmaking needs every peer's declaration under one key, so a key holds a dictionary. Each
subkey belongs to one writer (its peer id), which stamps every write with a version from its own
clock and signs it (records.py; the protocol checks signatures before anything is stored here);
replicas merge by the higher version, so a withdrawal (an empty value with a newer version)
beats an older declaration that arrives late. TTLs arrive as relative seconds and become local
monotonic deadlines.

Bounds that hold against many writers, since peer keys cost nothing to make:
- memory: every record and key is charged its value plus a fixed cost for what holds it, and
  the total stays within `max_bytes`; records per key and keys in all are capped too;
- per writer: one peer id may hold at most `max_per_writer` records here;
- when full, keys whose records all expired go first, then the key least recently written or
  read: a flood of new keys displaces the flood's own oldest keys, not the keys that live
  rounds poll, and no stranger can hold a slot against newer keys for a record's whole TTL;
- within a key that holds `max_subkeys` records, a new writer's record displaces the record
  stored here longest ago among writers that have not proven they live (`protected`: they
  answered this daemon's signed probe, matchmaking/liveness.py); a proven writer's record is
  displaced only by another proven writer's, when the key holds nothing else. Throw-away
  identities that fill a key thus churn through each other's places, hold them only while they
  keep writing, and never push out the peers this daemon matches with. (Not the lowest
  version: writers date their own versions, up to the clock skew ahead.) A daemon that holds a
  key only as a replica has probed none of its writers and protects none of them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kademlia.storage import IStorage

from moshpitd import timebase
from moshpitd.dht.records import MAX_TTL, Proof

# What Python holds per record besides its value and subkey (the StoredSub, its proof's three
# objects, the dict slot and the per-writer count) and per key (its dict and LRU slot): measured
# with tracemalloc (tests/unit/test_storage.py checks the charge covers the real cost).
RECORD_COST = 520
KEY_COST = 360
SWEEP_INTERVAL = 1.0  # s: a full scan for expired records, at most this often, when full
MAX_SUBKEY = 64
PLAIN_MAX_KEYS = 256  # plain kademlia values: moshpit never uses them, the stock RPCs may

__all__ = ["KEY_COST", "MAX_TTL", "RECORD_COST", "StoredSub", "SubkeyStorage"]


@dataclass(frozen=True, slots=True)
class StoredSub:
    value: bytes
    version: int
    deadline: float
    proof: Proof | None = None  # None only for records stored by tests without a network


def record_cost(subkey: bytes, value: bytes) -> int:
    return RECORD_COST + len(subkey) + len(value)


class SubkeyStorage(IStorage):
    """Bounded store of subkey records; also satisfies kademlia's IStorage for plain keys."""

    def __init__(
        self,
        max_keys: int = 4096,
        max_subkeys: int = 256,
        max_value_bytes: int = 1024,
        max_bytes: int = 64 << 20,
        max_per_writer: int = 1024,
        clock: Callable[[], float] = timebase.monotonic,
        protected: Callable[[bytes], bool] = lambda writer: False,
    ) -> None:
        self.max_keys = max_keys
        self.max_subkeys = max_subkeys
        self.max_value_bytes = max_value_bytes
        self.max_bytes = max_bytes
        self.max_per_writer = max_per_writer
        self.clock = clock
        self.protected = protected
        self._subs: OrderedDict[bytes, dict[bytes, StoredSub]] = OrderedDict()  # LRU first
        self._per_writer: dict[bytes, int] = {}
        self._plain: dict[bytes, tuple[float, object]] = {}
        self.bytes_used = 0
        self.records = 0
        self.evicted = 0  # live records dropped to make room
        self.refused_full = 0  # records refused by a cap (per key, per writer, memory)
        self._swept_at = -SWEEP_INTERVAL

    # --- subkey records -------------------------------------------------------------------
    def holds_writer(self, writer: bytes) -> bool:
        """Whether some record of `writer` is stored here (expired ones included until swept)."""
        return writer in self._per_writer

    def admissible(self, key: bytes, subkey: bytes, value: bytes, version: int,
                   ttl: float) -> bool:
        """Whether store_sub would take this record now, without storing it: the protocol
        asks before paying for a signature check."""
        if len(value) > self.max_value_bytes or not ttl >= 0 or len(subkey) > MAX_SUBKEY:
            return False
        now = self.clock()
        bucket = self._subs.get(key, {})
        old = bucket.get(subkey)
        if old is None or old.deadline <= now:
            if old is not None or len(bucket) < self.max_subkeys or \
                    self._displaced(bucket, subkey) is not None or \
                    any(s.deadline <= now for s in bucket.values()):
                return True
            self.refused_full += 1  # a key full of proven writers' records
            return False
        return (old.version, old.deadline) < (version, now + min(float(ttl), MAX_TTL))

    def _displaced(self, bucket: dict[bytes, StoredSub], writer: bytes) -> bytes | None:
        """Whose record a new `writer` takes the place of in a full key: the one stored longest
        ago of an unproven writer, else (a proven `writer` only) of a proven one."""
        for subkey in bucket:
            if not self.protected(subkey):
                return subkey
        return next(iter(bucket)) if self.protected(writer) else None

    def store_sub(self, key: bytes, subkey: bytes, value: bytes, version: int, ttl: float,
                  proof: Proof | None = None) -> bool:
        """Merge one record; returns False when it was refused or older than what we hold."""
        if not self.admissible(key, subkey, value, version, ttl):
            return False
        now = self.clock()
        self._expire(key, now)
        deadline = now + min(float(ttl), MAX_TTL)
        bucket = self._subs.get(key)
        old = bucket.get(subkey) if bucket is not None else None
        if old is None and self._per_writer.get(subkey, 0) >= self.max_per_writer:
            self._sweep(now)
            if self._per_writer.get(subkey, 0) >= self.max_per_writer:
                self.refused_full += 1
                return False
        if old is None and bucket is not None and len(bucket) >= self.max_subkeys:
            displaced = self._displaced(bucket, subkey)
            if displaced is None:
                self.refused_full += 1
                return False
            self.evicted += 1
            self._drop(key, [displaced])
            bucket = self._subs.get(key)
        grow = record_cost(subkey, value) - (record_cost(subkey, old.value) if old else 0)
        grow += KEY_COST if bucket is None else 0
        if not self._make_room(key, grow, bucket is None, now):
            self.refused_full += 1
            return False
        bucket = self._subs.get(key)
        if bucket is None:
            bucket = self._subs[key] = {}
        self._subs.move_to_end(key)
        if old is None:
            self._per_writer[subkey] = self._per_writer.get(subkey, 0) + 1
            self.records += 1
        else:
            del bucket[subkey]  # stored again: now the most recent (the eviction order)
        bucket[subkey] = StoredSub(value, version, deadline, proof)
        self.bytes_used += grow
        return True

    def get_subs(self, key: bytes) -> dict[bytes, tuple[bytes, int, float]]:
        """Live records as subkey -> (value, version, remaining ttl), tombstones included."""
        return {sk: (s.value, s.version, ttl) for sk, (s, ttl) in self.signed(key).items()}

    def signed(self, key: bytes, touch: bool = True) -> dict[bytes, tuple[StoredSub, float]]:
        """Live records with their proofs, as subkey -> (record, remaining ttl). A read keeps
        the key from eviction (`touch`); handing records over to a newcomer does not."""
        now = self.clock()
        self._expire(key, now)
        bucket = self._subs.get(key)
        if bucket is None:
            return {}
        if touch:
            self._subs.move_to_end(key)
        return {sk: (s, s.deadline - now) for sk, s in bucket.items()}

    def sub_keys(self) -> list[bytes]:
        return list(self._subs)

    def _make_room(self, key: bytes, grow: int, new_key: bool, now: float) -> bool:
        def full() -> bool:
            return (self.bytes_used + grow > self.max_bytes
                    or (new_key and len(self._subs) >= self.max_keys))

        if full():
            self._sweep(now)
        while full():
            victim = next((k for k in self._subs if k != key), None)
            if victim is None:
                return False
            bucket = self._subs[victim]
            self.evicted += len(bucket)
            self._drop(victim, list(bucket))
        return True

    def _expire(self, key: bytes, now: float) -> None:
        bucket = self._subs.get(key)
        if bucket is not None:
            self._drop(key, [sk for sk, s in bucket.items() if s.deadline <= now])

    def _sweep(self, now: float) -> None:
        """Drop every expired record; at most once per SWEEP_INTERVAL (it scans them all)."""
        if now - self._swept_at < SWEEP_INTERVAL:
            return
        self._swept_at = now
        for key in list(self._subs):
            self._expire(key, now)

    def _drop(self, key: bytes, subkeys: list[bytes]) -> None:
        bucket = self._subs[key]
        for sk in subkeys:
            stored = bucket.pop(sk)
            self.bytes_used -= record_cost(sk, stored.value)
            self.records -= 1
            left = self._per_writer[sk] - 1
            if left:
                self._per_writer[sk] = left
            else:
                del self._per_writer[sk]
        if not bucket:
            del self._subs[key]
            self.bytes_used -= KEY_COST

    # --- kademlia IStorage (plain values; kept bounded, used only by stock RPCs) ------------
    def __setitem__(self, key: bytes, value: object) -> None:
        size = len(value) if isinstance(value, bytes | str) else 8
        if size > self.max_value_bytes:
            return
        if key not in self._plain and len(self._plain) >= min(self.max_keys, PLAIN_MAX_KEYS):
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
