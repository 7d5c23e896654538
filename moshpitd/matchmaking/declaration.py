"""What a peer stores in the DHT to say it is looking for a group under a key.

A declaration is signed by its writer (a DHT subkey record, dht/records.py) and carries every
field of the peer's entry in a group: endpoints, weight, bandwidth, client mode. A leader takes
a follower only as it declared itself, and a follower checks every member of the group it gets
against that member's own declaration (matchmaking/vetting.py), so a leader can neither invent
members nor alter anyone's entry. A peer that stops looking writes its declaration again marked
withdrawn: matchmaking skips it, but it still vouches for the entry of a group that member has
just joined.

A host whose local trainers are the shards of its vector (moshpitd/local/) also declares one
short digest per rank of that rank's tensors: a host whose vector differs from a peer's can then
name the first of its ranks that differs (hosts that split the vector alike compare rank by
rank), instead of only "other tensors".
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

# A declaration lives one matchmaking attempt (matchmaking_attempt_timeout is at most 600 s):
# one signed to live longer is dated further back than any peer's attempt, and ignored
MAX_TTL = 600.0
UNPACKED_ENTRIES = 8192  # declarations remembered by their bytes (each at most a few 100 B)
_UNPACKED: OrderedDict[bytes, Declaration | None] = OrderedDict()
# 3: a shard host's per-rank digests; 2: the whole group entry and `withdrawn` (1 had endpoint,
# schema, client mode)
FORMAT = 3
MAX_ENDPOINT = 256
RANK_DIGEST = 4  # bytes: a rank's digest names a rank in an error, it grants nothing
# ranks one declaration names (a record's value is at most dht_max_value_bytes, 1 KiB by
# default); a host with more declares none, and its mismatches name no rank
MAX_RANK_DIGESTS = 64


@dataclass(frozen=True)
class Declaration:
    endpoint: str
    schema_hash: bytes
    client_mode: bool = False
    data_endpoint: str = ""
    weight: float = 1.0
    bandwidth: float = 1.0
    withdrawn: bool = False  # the peer stopped looking (it found a group, or left)
    ranks: bytes = b""  # a shard host's rank digests (rank_digests), in rank order

    def pack(self) -> bytes:
        return bytes(msgpack.packb([FORMAT, self.endpoint, self.schema_hash, self.client_mode,
                                    self.data_endpoint, float(self.weight),
                                    float(self.bandwidth), self.withdrawn, self.ranks]))

    @classmethod
    def unpack(cls, raw: bytes) -> Declaration | None:
        """None for anything that is not a well-formed declaration (peers are untrusted).
        Remembered by its bytes: every poll reads the key's declarations again, each as it
        was (a key flooded with hundreds of them cost a daemon their parsing twice a poll)."""
        if raw in _UNPACKED:
            _UNPACKED.move_to_end(raw)
            return _UNPACKED[raw]
        decl = cls._parse(raw)
        _UNPACKED[raw] = decl
        if len(_UNPACKED) > UNPACKED_ENTRIES:
            _UNPACKED.popitem(last=False)
        return decl

    @classmethod
    def _parse(cls, raw: bytes) -> Declaration | None:
        try:
            obj = msgpack.unpackb(raw)
        except Exception:
            return None
        if not (isinstance(obj, list) and len(obj) == 9 and obj[0] == FORMAT
                and not isinstance(obj[0], bool)):
            return None
        _, endpoint, schema, client_mode, data_endpoint, weight, bandwidth, withdrawn, ranks = obj
        if not (_endpoint(endpoint) and _endpoint(data_endpoint)
                and isinstance(schema, bytes) and isinstance(client_mode, bool)
                and isinstance(withdrawn, bool) and _amount(weight) and _amount(bandwidth)
                and _ranks(ranks)):
            return None
        return cls(endpoint, schema, client_mode, data_endpoint, float(weight),
                   float(bandwidth), withdrawn, ranks)

    def withdraw(self) -> Declaration:
        return Declaration(self.endpoint, self.schema_hash, self.client_mode,
                           self.data_endpoint, self.weight, self.bandwidth, withdrawn=True,
                           ranks=self.ranks)


def rank_digests(ranks: Sequence[Sequence[tuple[str, Sequence[int]]]]) -> bytes:
    """Each local rank's tensors, (dtype, shape) in order, as RANK_DIGEST bytes; b"" for more
    than MAX_RANK_DIGESTS ranks."""
    if len(ranks) > MAX_RANK_DIGESTS:
        return b""
    return b"".join(hashlib.blake2b(msgpack.packb([[d, list(shape)] for d, shape in schema]),
                                    digest_size=RANK_DIGEST).digest() for schema in ranks)


def first_differing_rank(ours: bytes, theirs: bytes) -> int | None:
    """Our first rank whose digest differs from that rank's in a peer's declaration; None when
    either declared no ranks, or ours are all among theirs (the peer has more ranks)."""
    if not ours or not theirs:
        return None
    count = len(ours) // RANK_DIGEST
    for rank in range(count):
        at = slice(rank * RANK_DIGEST, (rank + 1) * RANK_DIGEST)
        if ours[at] != theirs[at]:
            return rank
    return None


def _endpoint(value: object) -> bool:
    return isinstance(value, str) and len(value) <= MAX_ENDPOINT


def _ranks(value: object) -> bool:
    return (isinstance(value, bytes) and len(value) % RANK_DIGEST == 0
            and len(value) <= MAX_RANK_DIGESTS * RANK_DIGEST)


def _amount(value: object) -> bool:
    """A weight or a bandwidth: a finite number >= 0."""
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0)


@dataclass(frozen=True)
class Candidate:
    peer_id: bytes
    declaration: Declaration
    deadline: float  # in our monotonic clock
    version: int  # the declarer's own timestamp of its declaration

    @property
    def rank(self) -> tuple[int, bytes]:
        """The earliest declaration leads. Every reader sees the same version in the record,
        so all peers agree on the order; a skewed clock only changes who leads."""
        return (self.version, self.peer_id)


_BACKGROUND: set[asyncio.Future[Any]] = set()  # declarations and withdrawals in flight


def in_background(task: asyncio.Future[Any]) -> None:
    """Stores and withdrawals go on after the attempt that made them (a dead DHT node must
    not delay the round that follows); `wait_background` lets a draining daemon finish them."""
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


async def wait_background() -> None:
    """Let declarations and withdrawals in flight reach the DHT (a draining daemon waits)."""
    if _BACKGROUND:
        await asyncio.gather(*list(_BACKGROUND), return_exceptions=True)
