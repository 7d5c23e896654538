"""What a peer checks before it trusts a group: a follower the GroupInfo its leader sent, a
leader each peer that asks to join. Every entry of a group must be what its peer declared,
signed, under the key (matchmaking/declaration.py), and the weights must make a mean that
reducers can compute. The checks are pure; `DeclarationBook` holds what the DHT said.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moshpitd import timebase
from moshpitd.allreduce.group import Group, GroupMember
from moshpitd.dht.records import Proof, parse_proof
from moshpitd.matchmaking.declaration import MAX_TTL, Declaration
from moshpitd.matchmaking.request import MatchRequest
from moshpitd.proto import moshpit_pb2 as pb

# The largest positive weight of a group is at most this many times the smallest. Reducers
# scale weights so that the largest is 1 (allreduce/plan.py): a float32 weight below ~1e-38
# would be 0, and the parts whose heavy members dropped out would average to 0 unnoticed. No
# honest mix of sample counts comes near it.
MAX_WEIGHT_RATIO = 1e12
# s between two reads of a key that joins can cause: a joiner that never declared (or a flood
# of them) costs at most one DHT lookup per gap, whatever its rate (one identity once kept a
# daemon at half a core with 283 signed joins a second, each refused after its own lookup)
READ_GAP = 0.25

Lookup = Callable[[bytes], Declaration | None]

log = logging.getLogger(__name__)


def weights_fault(weights: Sequence[float]) -> str | None:
    """Why these weights make no mean a reducer can compute, or None."""
    if not all(math.isfinite(w) and w >= 0 for w in weights):
        return "a weight is not a finite number >= 0"
    if not math.isfinite(sum(weights)):
        return "the weights' total overflows"
    positive = [w for w in weights if w > 0]
    if positive and max(positive) > MAX_WEIGHT_RATIO * min(positive):
        return (f"weights {min(positive):g} and {max(positive):g} lie more than "
                f"{MAX_WEIGHT_RATIO:g} apart")
    return None


def entry_fault(member: GroupMember, declared: Declaration | None,
                schema_hash: bytes) -> str | None:
    """Why `member` is not the peer as it declared itself under the key, or None."""
    who = f"member {member.peer_id.hex()[:8]}"
    if declared is None:
        return f"{who} has no signed declaration under the key"
    if declared.schema_hash != schema_hash:
        return f"{who} declared other tensors, codec, aggregation or data encryption"
    differ = [name for name, theirs, ours in (
        ("endpoint", member.endpoint, declared.endpoint),
        ("data endpoint", member.data_endpoint, declared.data_endpoint),
        ("weight", member.weight, declared.weight),
        ("client mode", member.client_mode, declared.client_mode)) if theirs != ours]
    if not member.bandwidth <= declared.bandwidth:  # the leader may lower it (rates.py)
        differ.append("bandwidth")
    if differ:
        return f"{who}'s {', '.join(differ)} differ from its declaration"
    return None


def shape_fault(group: Group, req: MatchRequest, me: bytes) -> str | None:
    """What a follower checks of a GroupInfo before looking at anyone's entry."""
    members = group.members
    if group.key != req.key:
        return f"it is for key {group.key[:64]!r}"
    if group.schema_hash != req.schema_hash:
        return "its tensors, codec, aggregation or data encryption differ from ours"
    if group.codec != req.codec:
        return f"its codec is {group.codec[:16]!r}, we asked for {req.codec!r}"
    if len(group.group_id) != 16:
        return "its group id is malformed"
    if not 2 <= len(members) <= req.target_size:
        return f"it has {len(members)} members, we asked for at most {req.target_size}"
    if len({m.peer_id for m in members}) != len(members):
        return "a member is listed twice"
    if me not in {m.peer_id for m in members}:
        return "we are not in it"
    why = weights_fault([m.weight for m in members])
    return None if why is None else f"its {why}"


def entries_fault(group: Group, req: MatchRequest, lookup: Lookup) -> str | None:
    for m in group.members:
        why = entry_fault(m, lookup(m.peer_id), req.schema_hash)
        if why is not None:
            return why
    return None


# Declarations a book takes from joins (each one's signature checked) before it takes no more
# from strangers: more than the peers one key matches, far fewer than a flood of identities.
MAX_CARRIED_BOOK = 4096


@dataclass
class DeclarationBook:
    """The latest declaration of each peer read under one key, withdrawn ones included: a
    member that found its group withdraws at once, and its withdrawn declaration still
    vouches for its entry to the members that check it a moment later."""

    read: Callable[[], Awaitable[Mapping[bytes, Any]]]  # DHTNode.get_subs under the key
    mine: tuple[bytes, Declaration] | None = None
    local: Callable[[], Mapping[bytes, Any]] | None = None  # DHTNode.local_subs: no lookup
    clock: Callable[[], float] = timebase.monotonic
    # DHTNode.verify_sub under the key: a record its writer handed us, checked, or None
    verify: Callable[[bytes, bytes, int, Proof], Any] | None = None

    def __post_init__(self) -> None:
        self._latest: dict[bytes, tuple[int, Declaration]] = {}
        self._reading: asyncio.Future[None] | None = None
        self._last_read = -math.inf
        self.reads = 0

    def absorb(self, subs: Mapping[bytes, Any]) -> None:
        """Records from a lookup (`SubRecord`s: value and version)."""
        for peer_id, rec in subs.items():
            decl = Declaration.unpack(rec.value)
            held = self._latest.get(peer_id)
            if decl is not None and (held is None or held[0] < rec.version):
                self._latest[peer_id] = (rec.version, decl)

    def carried(self, join: pb.JoinRequest) -> None:
        """The declaration a join carries (its writer's signed DHT record), once its
        signature holds: what a lookup of the key would bring, a round trip sooner."""
        held = self._latest.get(join.peer_id)
        if held is not None and held[0] >= join.declaration_version:
            return  # nothing newer: no signature to check
        if held is None and len(self._latest) >= MAX_CARRIED_BOOK:
            return  # a flood of joins under made-up ids: the key's own reads still count
        proof = parse_proof([join.declaration_ttl, join.public_key,
                             join.declaration_signature])
        if (self.verify is None or not join.declaration or proof is None
                or not 0.0 <= proof.ttl <= MAX_TTL):
            return
        rec = self.verify(join.peer_id, join.declaration, join.declaration_version, proof)
        if rec is not None and rec.ttl > 0:
            self.absorb({join.peer_id: rec})

    def get(self, peer_id: bytes) -> Declaration | None:
        if self.mine is not None and peer_id == self.mine[0]:
            return self.mine[1]
        held = self._latest.get(peer_id)
        return None if held is None else held[1]

    async def refresh(self) -> None:
        """Read the key again; callers at the same moment share one lookup, and one starts at
        most READ_GAP s after the last one started."""
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._read_once())
        await asyncio.shield(self._reading)

    async def _read_once(self) -> None:
        wait = self._last_read + READ_GAP - self.clock()
        if wait > 0:
            await asyncio.sleep(wait)
        self._last_read = self.clock()
        self.reads += 1
        try:
            self.absorb(await self.read())
        except Exception as exc:  # what we hold is still checked; an unknown member fails
            log.debug("reading declarations failed: %r", exc)

    async def vouched(self, check: Callable[[Lookup], str | None]) -> str | None:
        """`check` against what we read; if it fails, against what this daemon holds as a
        replica, then once more after reading the key again (a peer may have declared since
        our last poll)."""
        why = check(self.get)
        if why is None:
            return None
        if self.local is not None:  # what this daemon holds as a replica: no lookup
            self.absorb(self.local())
            if check(self.get) is None:
                return None
        await self.refresh()
        return check(self.get)
