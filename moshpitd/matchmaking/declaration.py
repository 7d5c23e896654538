"""What a peer stores in the DHT to say it is looking for a group under a key."""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

# A declaration lives one matchmaking attempt (matchmaking_attempt_timeout is at most 600 s):
# one signed to live longer is dated further back than any peer's attempt, and ignored
MAX_TTL = 600.0


@dataclass(frozen=True)
class Declaration:
    endpoint: str
    schema_hash: bytes
    client_mode: bool = False

    def pack(self) -> bytes:
        return bytes(msgpack.packb([1, self.endpoint, self.schema_hash, self.client_mode]))

    @classmethod
    def unpack(cls, raw: bytes) -> Declaration | None:
        """None for anything that is not a well-formed declaration (peers are untrusted)."""
        try:
            obj = msgpack.unpackb(raw)
        except Exception:
            return None
        if not (isinstance(obj, list) and len(obj) == 4 and obj[0] == 1
                and isinstance(obj[1], str) and len(obj[1]) <= 256
                and isinstance(obj[2], bytes) and isinstance(obj[3], bool)):
            return None
        return cls(obj[1], obj[2], obj[3])


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
