"""A group as every member sees it once the leader has assembled it."""

from __future__ import annotations

import hashlib
import math
from dataclasses import astuple, dataclass
from functools import cached_property

import msgpack

from moshpitd.allreduce.spans import optimal_shares
from moshpitd.proto import moshpit_pb2 as pb

DIGEST_DOMAIN = b"moshpit/group/1\x00"


@dataclass(frozen=True)
class GroupMember:
    peer_id: bytes
    endpoint: str
    weight: float
    client_mode: bool = False
    bandwidth: float = 1.0
    data_endpoint: str = ""


@dataclass(frozen=True)
class Group:
    group_id: bytes
    key: str
    round: int
    schema_hash: bytes
    members: tuple[GroupMember, ...]
    codec: str = "none"

    def index_of(self, peer_id: bytes) -> int:
        for i, m in enumerate(self.members):
            if m.peer_id == peer_id:
                return i
        raise KeyError(peer_id.hex())

    @cached_property
    def digest(self) -> bytes:
        """SHA-256 of every field of the group in a fixed encoding: what the leader signs and
        what every data-plane handshake binds to, so members that were shown different groups
        under one id cannot open streams to each other. Fields added to the dataclasses are
        covered without a change here."""
        fields = [self.group_id, self.key, self.round, self.schema_hash, self.codec,
                  [list(astuple(m)) for m in self.members]]
        return hashlib.sha256(DIGEST_DOMAIN + msgpack.packb(fields, use_bin_type=True)).digest()

    def route_to(self, receiver: int) -> tuple[bytes, bytes, bytes]:
        """What a data-plane handshake to member `receiver` binds to (transport/handshake.py):
        the id streams are routed by, the digest, and the receiver's peer id."""
        return self.group_id, self.digest, self.members[receiver].peer_id

    @property
    def listeners(self) -> int:
        """Bitmask of the members of weight 0 (a joiner, say) in a group that has a weighted
        mean: they contribute nothing, so nobody waits for their parts; they only receive the
        result. 0 when every weight is 0 (that round is skipped: runner.py)."""
        if not any(m.weight > 0 for m in self.members):
            return 0
        return sum(1 << i for i, m in enumerate(self.members) if not m.weight > 0)

    @property
    def shares(self) -> list[float]:
        """Span shares that make the round's expected time minimal at the members' declared
        rates (allreduce/spans.py). Client-mode peers accept no connections, and listeners
        are not waited for (a joiner may be slow, or leave), so they own nothing; a listener
        owns a span only when no weighted member can."""
        rates = [min(max(m.bandwidth, 1e-9), 1e12) if math.isfinite(m.bandwidth) else 1e-9
                 for m in self.members]
        able = [not m.client_mode and math.isfinite(m.bandwidth) for m in self.members]
        listeners = self.listeners
        senders = [not listeners >> i & 1 for i in range(len(self.members))]
        weighted = [a and s for a, s in zip(able, senders, strict=True)]
        owners = weighted if any(weighted) else able
        if not any(owners):
            return [0.0] * len(self.members)  # span_bounds refuses it, as it always did
        return optimal_shares(rates, rates, senders, owners)

    def to_proto(self) -> pb.GroupInfo:
        return pb.GroupInfo(
            group_id=self.group_id, group_key=self.key, round=self.round,
            schema_hash=self.schema_hash, codec=self.codec,
            members=[pb.Member(peer_id=m.peer_id, endpoint=m.endpoint, weight=m.weight,
                               client_mode=m.client_mode, bandwidth=m.bandwidth,
                               data_endpoint=m.data_endpoint)
                     for m in self.members],
        )

    @classmethod
    def from_proto(cls, info: pb.GroupInfo) -> Group:
        return cls(
            group_id=info.group_id, key=info.group_key, round=info.round,
            schema_hash=info.schema_hash, codec=info.codec or "none",
            members=tuple(GroupMember(m.peer_id, m.endpoint, m.weight, m.client_mode,
                                      m.bandwidth, m.data_endpoint) for m in info.members),
        )
