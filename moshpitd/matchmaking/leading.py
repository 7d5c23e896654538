"""The leader's side of matchmaking: who may join our group, assembling it, releasing it."""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field, replace

from moshpitd import timebase
from moshpitd.allreduce.group import Group, GroupMember
from moshpitd.dht.records import Proof
from moshpitd.hooks import NO_HOOKS, Hooks
from moshpitd.matchmaking.admission import JoinAdmission
from moshpitd.matchmaking.declaration import Candidate
from moshpitd.matchmaking.request import MatchRequest, Self
from moshpitd.matchmaking.vetting import DeclarationBook, entry_fault, weights_fault
from moshpitd.proto import moshpit_pb2 as pb
from moshpitd.transport.dataplane import split_endpoint

log = logging.getLogger(__name__)

# 2: owners answer a data-plane HELLO with READY (a daemon of version 1 would take that frame
# for a protocol error), so daemons of different versions do not form groups.
# 3: members of weight 0 own no span and send no parts (a version-2 daemon would plan other
# spans and wait for their parts).
# 4: every group entry must match its peer's signed declaration of format 2.
# 5: joins and GroupInfo are signed by peer keys, and data-plane streams open with a signed
# handshake (transport/handshake.py).
# 6: declarations of format 3 (a shard host's rank digests): peers of 5 cannot read them.
# 7: shares fill the members' slack to a common level (allreduce/spans.py): a version-6 daemon
# would plan other spans from the same rates.
# 8: a GroupInfo carries every follower's signed join, and members refuse a group without them.
# 9: a join carries its signed declaration, and its signature covers it (a version-8 leader
# would sign-check the join without those fields and refuse it as altered).
PROTOCOL_VERSION = 9


@dataclass
class _Follower:
    request: pb.JoinRequest
    tls_binding: bytes = b""
    outbox: asyncio.Queue[pb.JoinResponse] = field(default_factory=asyncio.Queue)
    joined: float = field(default_factory=timebase.monotonic)


class GroupLeader:
    """Our side as a potential leader: the Join calls of our followers, the group they form,
    and where newcomers are sent once we follow someone. The matchmaker opens and closes it and
    tells it whom we ask and follow; `on_join` wakes the matchmaker when someone joins."""

    def __init__(self, me: Self, request: MatchRequest, on_join: Callable[[], None],
                 book: DeclarationBook | None = None, hooks: Hooks = NO_HOOKS) -> None:
        self.me = me
        self.req = request
        self._on_join = on_join
        self.book = book  # None: joiners are not checked against declarations (unit tests)
        self.hooks = hooks
        self.accepting = False
        self.followers: dict[bytes, _Follower] = {}
        self.last_join = 0.0  # when the latest follower joined us (to learn arrival spread)
        self.following: Candidate | None = None  # the leader that accepted us, if any
        self.asking: bytes | None = None  # the peer we are asking to lead us, if any

    @property
    def members(self) -> frozenset[bytes]:
        return frozenset(self.followers)

    def open(self) -> None:
        """An attempt starts: accept followers (a client-mode peer never leads). Done before
        our declaration can be read, or early askers would get NOT_LOOKING."""
        self.accepting = not self.req.client_mode

    def close(self) -> None:
        self.accepting = False

    def follow(self, leader: Candidate) -> None:
        """A leader accepted us: stop accepting, and send our followers and askers there."""
        self.following = leader
        self.accepting = False
        self.disband(leader)

    def unfollow(self, reopen: bool) -> None:
        """The leader we followed let us go: lead again if our attempt is still on."""
        self.following = None
        self.accepting = reopen and not self.req.client_mode

    def assemble(self) -> Group:
        members = [GroupMember(self.me.peer_id, self.me.endpoint, self.req.weight,
                               self.req.client_mode, self.me.bandwidth, self.me.data_endpoint)]
        members += [_member(f.request) for f in self.followers.values()]
        rates = self.me.rates
        if rates is not None:  # a follower's declared rate, at most what its streams carried
            members = [members[0]] + [replace(m, bandwidth=rates.capped_rate(
                m.peer_id, m.bandwidth, len(members))) for m in members[1:]]
        if sum(m.weight for m in members) <= 0:
            log.info("group under %s has zero total weight", self.req.key)
        group = self.hooks.leading(Group(os.urandom(16), self.req.key, 0, self.req.schema_hash,
                                         tuple(members), self.req.codec))
        info = group.to_proto()
        info.admissions.extend(pb.Admission(join=f.request, tls_binding=f.tls_binding)
                               for f in self.followers.values())
        if self.me.auth is not None:
            self.me.auth.sign_group(info, group)
        self.accepting = False
        for f in self.followers.values():
            f.outbox.put_nowait(pb.JoinResponse(code=pb.GROUP_ASSEMBLED, group_info=info))
        self.followers.clear()
        return group

    def disband(self, leader: Candidate | None, why: str = "leader left the group") -> None:
        """Release our followers, pointing them at our new leader if we have one."""
        for f in self.followers.values():
            resp = pb.JoinResponse(code=pb.DISBANDED, message=why)
            if leader is not None:
                resp.suggested_leader = leader.declaration.endpoint
                resp.suggested_leader_id = leader.peer_id
            f.outbox.put_nowait(resp)
        self.followers.clear()

    def release_expired(self, deadlines: Mapping[bytes, float], now: float) -> int:
        """Let go of each follower whose attempt has ended by its declaration (`deadlines`,
        our clock; one from before it joined is an earlier attempt's and tells nothing). Such
        a follower is about to leave on its own clock, and may already have: a group that
        counted it on then (a last member joining as it hangs up) would start without it,
        while it searches on alone. Told now, it starts its next attempt and asks again."""
        gone = [peer for peer, f in self.followers.items()
                if f.joined < deadlines.get(peer, math.inf) <= now]
        for peer in gone:
            self.followers.pop(peer).outbox.put_nowait(pb.JoinResponse(
                code=pb.DISBANDED, message="your attempt ended before the group formed"))
        return len(gone)

    def next_release(self, deadlines: Mapping[bytes, float]) -> float:
        """When `release_expired` lets the next follower go, by these deadlines."""
        return min((d for peer, f in self.followers.items()
                    if (d := deadlines.get(peer, math.inf)) > f.joined), default=math.inf)

    # --- leading: the server side of Join ---------------------------------------------------
    async def handle_join(self, request: pb.JoinRequest, tls_binding: bytes = b"",
                          admission: JoinAdmission | None = None
                          ) -> AsyncIterator[pb.JoinResponse]:
        """`tls_binding`: the digest of the TLS certificate the caller presented, if any.
        `admission`: the daemon's bound on held joins, taken once the join proved its peer
        id, so a join claiming someone else's id holds none of that peer's share."""
        reject = self._check_join(request)
        if reject is None:  # once (its nonce is kept), and before the DHT read it saves
            reject = self._check_identity(request, tls_binding)
        if reject is not None:
            yield reject
            return
        slot = (admission.admit(request.peer_id, self.req.attempt_seconds)
                if admission is not None else None)
        if isinstance(slot, str):
            yield pb.JoinResponse(code=pb.GROUP_FULL, message=slot)
            return
        try:
            async for response in self._take_join(request, tls_binding):
                yield response
        finally:
            if admission is not None and slot is not None:
                admission.release(slot)

    async def _take_join(self, request: pb.JoinRequest, tls_binding: bytes = b""
                         ) -> AsyncIterator[pb.JoinResponse]:
        """A proven join: checked against its declaration, then held until the group forms."""
        reject = None
        if self.book is not None:
            self.book.carried(request)
            why = await self.book.vouched(
                lambda get: entry_fault(_member(request), get(request.peer_id),
                                        self.req.schema_hash))
            if why is not None:
                reject = pb.JoinResponse(code=pb.BAD_REQUEST, message=f"refused: {why}")
            else:  # we may have assembled or left while reading the DHT
                reject = self._check_join(request)
        if reject is None:
            reject = await self._check_alive(request)
        if reject is not None:
            yield reject
            return
        follower = _Follower(request, tls_binding)
        self.followers[request.peer_id] = follower
        self.last_join = timebase.monotonic()
        self._on_join()
        try:
            yield pb.JoinResponse(code=pb.ACCEPTED)
            yield await follower.outbox.get()
        finally:
            if self.followers.get(request.peer_id) is follower:
                del self.followers[request.peer_id]

    def _check_join(self, request: pb.JoinRequest) -> pb.JoinResponse | None:
        def no(code: pb.JoinCode, message: str) -> pb.JoinResponse:
            return pb.JoinResponse(code=code, message=message)

        if request.protocol_version != PROTOCOL_VERSION:
            return no(pb.PROTOCOL_MISMATCH, f"protocol {request.protocol_version} != "
                                            f"{PROTOCOL_VERSION}")
        if (len(request.peer_id) != 20 or not request.endpoint
                or not _valid_endpoint(request.data_endpoint)
                or not request.weight >= 0 or not math.isfinite(request.weight)
                or not (math.isfinite(request.bandwidth) and request.bandwidth >= 0)):
            return no(pb.BAD_REQUEST, "peer id, endpoints, weight or bandwidth malformed")
        if request.group_key != self.req.key:
            return no(pb.WRONG_KEY, f"this peer averages under {self.req.key!r}")
        if not self.accepting:
            if self.following is not None:
                resp = no(pb.NOT_A_LEADER, "this peer follows another leader")
                resp.suggested_leader = self.following.declaration.endpoint
                resp.suggested_leader_id = self.following.peer_id
                return resp
            return no(pb.NOT_LOOKING, "not accepting followers now")
        if request.schema_hash != self.req.schema_hash or request.codec != self.req.codec:
            return no(pb.BAD_SCHEMA, "tensor dtypes/shapes, codec, aggregation or data "
                      "encryption differ from this group's")
        if self.asking == request.peer_id and request.peer_id < self.me.peer_id:
            # Both of us asked the other at once: the lower peer id leads, on both sides.
            return no(pb.NOT_LOOKING, "we are asking you to lead; the lower peer id leads")
        if request.peer_id in self.me.liars:
            return no(pb.NOT_LOOKING, "this peer's results failed our check: we no longer "
                      "group with it")
        if request.peer_id == self.me.peer_id or request.peer_id in self.followers:
            return no(pb.DUPLICATE_PEER, "peer is already a member")
        if 1 + len(self.followers) >= self.req.target_size:
            return no(pb.GROUP_FULL, f"group already has {self.req.target_size} members")
        why = weights_fault([self.req.weight, request.weight,
                             *(f.request.weight for f in self.followers.values())])
        if why is not None:
            return no(pb.BAD_REQUEST, f"with this peer's weight, the group's {why}")
        return None

    async def _check_alive(self, request: pb.JoinRequest) -> pb.JoinResponse | None:
        """A joiner we have not heard from lately must answer a probe at the endpoint it
        declared: one that never will (a ghost that joins and sends nothing) is refused
        before it holds a place in a group. Once per peer (Liveness remembers); client-mode
        peers take no calls and are taken as they come."""
        live = self.me.liveness
        if live is None or request.client_mode or live.proven(request.peer_id):
            return None
        if live.failed(request.peer_id) or not await live.ask(request.endpoint,
                                                               request.peer_id):
            return pb.JoinResponse(code=pb.BAD_REQUEST, message=(
                f"refused: no signed answer to our probe at {request.endpoint[:64]}, the "
                "endpoint this peer declared"))
        return self._check_join(request)  # we may have assembled or left meanwhile

    def _check_identity(self, request: pb.JoinRequest, tls_binding: bytes
                        ) -> pb.JoinResponse | None:
        """After every refusal that costs nothing: a signature costs ~0.1-0.2 ms to verify,
        and only a join we would take needs it."""
        why = ("this leader has no peer key" if self.me.auth is None
               else self.me.auth.check_join(request, tls_binding))
        if why is None:
            return None
        return pb.JoinResponse(code=pb.UNAUTHENTICATED,
                               message=f"join as {request.peer_id.hex()[:8]} refused: {why}")


def join_request(me: Self, req: MatchRequest, leader_id: bytes,
                 carried: tuple[bytes, int, Proof] | None) -> pb.JoinRequest:
    """What we send a leader to be taken: our entry, the declaration it was made under
    (`carried`: value, version and proof, as stored in the DHT) and, with a peer key, the
    signature that proves our peer id to that leader alone."""
    request = pb.JoinRequest(
        group_key=req.key, peer_id=me.peer_id, endpoint=me.endpoint,
        schema_hash=req.schema_hash, weight=req.weight, client_mode=req.client_mode,
        protocol_version=PROTOCOL_VERSION, data_endpoint=me.data_endpoint,
        bandwidth=me.bandwidth, codec=req.codec)
    if carried is not None:
        request.declaration, request.declaration_version, proof = carried
        request.declaration_ttl, request.declaration_signature = proof.ttl, proof.signature
    if me.auth is not None:  # the leader takes only joins that prove our id
        me.auth.sign_join(request, leader_id)
    return request


def _member(r: pb.JoinRequest) -> GroupMember:
    """A follower's entry in the group, as it asked to join."""
    return GroupMember(r.peer_id, r.endpoint, r.weight, r.client_mode, r.bandwidth,
                       r.data_endpoint)


def _valid_endpoint(endpoint: str) -> bool:
    """host:port, as members will connect to it (the group would carry a bad one to all)."""
    try:
        host, port = split_endpoint(endpoint)
    except ValueError:
        return False
    return bool(host) and 0 < port < 65536


def not_looking(key: str) -> pb.JoinResponse:
    return pb.JoinResponse(code=pb.NOT_LOOKING, message=f"not matchmaking under {key!r}")
