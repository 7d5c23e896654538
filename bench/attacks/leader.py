"""A key holder that leads a group under a key with a declaration of its own, dated early so
that it ranks first: it can hold its followers' GroupInfo back (and open impostor streams
meanwhile), or never assemble at all."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import AsyncIterator

import numpy as np

from bench.attacks.dht_wire import RawDHT, hostport
from bench.attacks.loop import LoopThread
from moshpitd.allreduce.butterfly import ButterflyRound, RoundResult
from moshpitd.allreduce.codecs import get_codec
from moshpitd.allreduce.deadlines import DeadlinePolicy
from moshpitd.allreduce.group import Group, GroupMember
from moshpitd.allreduce.layout import FlatView, TensorSpec
from moshpitd.allreduce.registry import RoundRegistry
from moshpitd.auth import SwarmKey
from moshpitd.clock import RoundClock
from moshpitd.hooks import NO_HOOKS
from moshpitd.identity import PeerKey
from moshpitd.matchmaking.declaration import Declaration
from moshpitd.matchmaking.signing import PeerAuth, is_probe
from moshpitd.proto import moshpit_pb2 as pb
from moshpitd.transport.control import Caller
from moshpitd.transport.dataplane import HEADER, HELLO, PART
from moshpitd.transport.grpc_server import AveragerServer
from moshpitd.transport.handshake import Handshake
from moshpitd.transport.security import Security

MAX_PAYLOAD = (2 << 20) + 4096  # the daemons' default part_size * 2 + 4096


class FakeLeader:
    """A key holder that leads a group under `key` with a declaration of its own. Once
    `followers` joined, and before it hands out the GroupInfo, it opens streams to every honest
    owner as every other member (signed with its own key, or claiming the member's public key)
    and sends 1000.0 there; `released` waits until the owners hold those streams. Then it
    averages 1000.0 as itself, an honest member with the weight of one."""

    def __init__(self, loop: LoopThread, swarm: SwarmKey, key: str, schema: bytes,
                 elems: int, followers: int) -> None:
        self.loop, self.swarm, self.key, self.schema = loop, swarm, key, schema
        self.peer = PeerKey.generate()
        self.auth = PeerAuth(self.peer)
        self.handshake = Handshake(self.peer, swarm, encrypt=True)
        self.values = np.full(elems, 1000.0, dtype=np.float32)
        self.followers = followers
        self.listed: list[GroupMember] = []  # members it lists without their joins
        self.joins: dict[bytes, pb.JoinRequest] = {}  # by peer id, in the order they came
        self.assembling = False
        self.impostors: list[socket.socket] = []
        self.assembled: asyncio.Future[pb.GroupInfo] | None = None
        self.release: asyncio.Event | None = None
        self.round: asyncio.Future[RoundResult] | None = None
        self.registry = RoundRegistry(MAX_PAYLOAD, self.handshake)
        self.server = AveragerServer(self._join, self._state, security=Security(swarm))
        self.grpc_endpoint, self.data_endpoint = loop.run(self._start())

    async def _start(self) -> tuple[str, str]:
        self.assembled = asyncio.get_running_loop().create_future()
        self.release = asyncio.Event()
        dport = await self.registry.start("127.0.0.1", 0)
        gport = await self.server.start("127.0.0.1", 0)
        return f"127.0.0.1:{gport}", f"127.0.0.1:{dport}"

    async def _state(self, request: pb.StateRequest, caller: Caller
                     ) -> AsyncIterator[pb.StateChunk]:
        return
        yield

    async def _join(self, request: pb.JoinRequest, caller: Caller
                    ) -> AsyncIterator[pb.JoinResponse]:
        assert self.assembled is not None
        if is_probe(request):  # it proves itself alive, as any daemon does
            yield self.auth.answer_probe(request)
            return
        if request.group_key != self.key or (request.peer_id not in self.joins
                                             and len(self.joins) >= self.followers):
            yield pb.JoinResponse(code=pb.NOT_LOOKING)
            return
        self.joins[request.peer_id] = request  # (a follower that asks again: its latest)
        last = len(self.joins) == self.followers and not self.assembling
        self.assembling |= last
        yield pb.JoinResponse(code=pb.ACCEPTED)
        if last:
            await self._assemble()
        info = await self.assembled
        yield pb.JoinResponse(code=pb.GROUP_ASSEMBLED, group_info=info)

    async def _assemble(self) -> None:
        assert self.assembled is not None and self.release is not None
        me = GroupMember(self.peer.peer_id, self.grpc_endpoint, 1.0, False, 1.0,
                         self.data_endpoint)
        group = Group(os.urandom(16), self.key, 0, self.schema, (me, *(
            GroupMember(r.peer_id, r.endpoint, r.weight, r.client_mode, r.bandwidth,
                        r.data_endpoint) for r in self.joins.values()), *self.listed), "none")
        await asyncio.to_thread(self._impersonate, group)
        await self.release.wait()  # the GroupInfo held back until the owners hold the streams
        view = FlatView(self.values.data.cast("B"),
                        [TensorSpec("float32", self.values.shape, 0)])
        rnd = ButterflyRound(group, 0, view, get_codec("none"), self.registry.connect,
                             self.handshake, hooks=NO_HOOKS, aggregation="trimmed_mean",
                             checked=True)  # as the swarm key makes every member check
        self.registry.register(rnd)
        deadlines = RoundClock(20.0, 5.0, DeadlinePolicy()).allreduce(rnd.plan.wire_bytes())
        self.round = asyncio.ensure_future(rnd.run(deadlines))
        info = group.to_proto()  # with the joins it took, as an honest leader's carries them
        info.admissions.extend(pb.Admission(join=r) for r in self.joins.values())
        self.assembled.set_result(self.auth.sign_group(info, group))

    def _impersonate(self, group: Group) -> None:
        """Streams to each honest owner as each other honest member: a HELLO signed by our key
        naming us as that member, and one that carries the member's own public key (from its
        join) but our signature; then a part of 1000.0 in the clear."""
        part = np.full(1024, 1000.0, dtype=np.float32).tobytes()
        for owner in range(1, len(group.members)):
            host, port = group.members[owner].data_endpoint.rsplit(":", 1)
            for sender in range(1, len(group.members)):
                if sender == owner:
                    continue
                claimed = Handshake(self.peer, self.swarm, encrypt=True)
                wire, _ = claimed.hello(*group.route_to(owner), sender, owner)
                if sender % 2:  # the victim's public key, our signature
                    inner = bytearray(self.swarm.open(b"data", _ctx(sender, owner), wire))
                    inner[18:50] = list(self.joins.values())[sender - 1].public_key
                    wire = self.swarm.seal(b"data", _ctx(sender, owner), bytes(inner))
                s = socket.create_connection((host, int(port)), timeout=5)
                s.sendall(HEADER.pack(HELLO, 0, 0, owner, len(wire), sender) + wire
                          + HEADER.pack(PART, 0, 0, 0, len(part), 0) + part)
                self.impostors.append(s)

    def outcome(self) -> RoundResult:
        """Our own round's result, once it is over."""
        async def wait() -> RoundResult:
            while self.round is None:
                await asyncio.sleep(0.01)
            return await self.round
        return self.loop.run(wait())

    def hand_out_group(self) -> None:
        assert self.release is not None
        self.loop.loop.call_soon_threadsafe(self.release.set)

    def declaration(self) -> Declaration:
        """Its entry in the group it leads, as followers check it."""
        return Declaration(self.grpc_endpoint, self.schema, data_endpoint=self.data_endpoint)

    def declare_at(self) -> int:
        """A declaration's version ten seconds in the past: it ranks before the honest peers'
        (declarations are dated within their lifetime of the reader's clock)."""
        return time.time_ns() - 10 * 10**9

    def declare(self, dhts: list[str], ttl: float) -> None:
        """Its signed declaration under its key, stored on each of these DHT nodes, dated
        ten seconds back with lifetime `ttl`."""
        assert self.declare_on(dhts, ttl) == len(dhts)

    def declare_on(self, dhts: list[str], ttl: float, timeout: float = 5.0) -> int:
        """As `declare`; returns how many of the nodes took it (a dead one answers nothing)."""
        took = 0
        with RawDHT(self.swarm) as raw:
            for dht in dhts:
                took += raw.store_sub(hostport(dht), self.key, self.peer,
                                      self.declaration().pack(), self.declare_at(), ttl=ttl,
                                      timeout=timeout) is True
                raw.leave(hostport(dht))
        return took

    def close(self) -> None:
        for s in self.impostors:
            s.close()
        self.loop.run(self.registry.stop())
        self.loop.run(self.server.stop(0))


def _ctx(sender: int, receiver: int) -> bytes:
    return b"hello" + sender.to_bytes(4, "big") + receiver.to_bytes(4, "big")

