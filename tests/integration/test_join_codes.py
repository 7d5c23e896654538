"""The Join stream: a leader driven by hand answers every JoinCode the protocol defines
(MoshpitNodes in this process, every Join over gRPC; helpers from test_matchmaking)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from moshpitd.allreduce.group import Group
from moshpitd.dht.network import SubRecord
from moshpitd.identity import PeerKey
from moshpitd.matchmaking.declaration import Candidate, Declaration
from moshpitd.matchmaking.leading import PROTOCOL_VERSION
from moshpitd.matchmaking.matchmaker import Matchmaker
from moshpitd.matchmaking.signing import PeerAuth
from moshpitd.node import MoshpitNode
from moshpitd.proto import moshpit_pb2 as pb
from moshpitd.transport.grpc_server import ChannelPool
from tests.integration.test_matchmaking import SCHEMA, matchmaker, run_nodes

PEERS = [PeerKey.generate() for _ in range(40)]  # pid(0..9), and 30 to pick from
KEYS = {k.peer_id: k for k in PEERS}


def spare_key(wanted: Callable[[bytes], bool]) -> bytes:
    """A peer id beyond pid(0..9) that `wanted` takes, whose key the test holds (keys are
    drawn until one fits: the node's own id is random, and may be near either end)."""
    for key in PEERS[10:]:
        if wanted(key.peer_id):
            return key.peer_id
    while not wanted((key := PeerKey.generate()).peer_id):
        pass
    PEERS.append(key)
    KEYS[key.peer_id] = key
    return key.peer_id


def pid(i: int) -> bytes:
    return PEERS[i].peer_id


def signed_join(peer_id: bytes, key: str = "k", *, leader: bytes = b"", **fields: Any
                 ) -> pb.JoinRequest:
    """A join as peer `peer_id`, signed with its key for `leader` where the test holds it."""
    base: dict[str, Any] = {
        "group_key": key, "peer_id": peer_id, "endpoint": "127.0.0.1:1",
        "data_endpoint": "127.0.0.1:2", "schema_hash": SCHEMA, "weight": 1.0,
        "bandwidth": 1.0, "protocol_version": PROTOCOL_VERSION, "codec": "none",
    }
    request = pb.JoinRequest(**{**base, **fields})
    signer = KEYS.get(peer_id)
    if signer is not None:
        PeerAuth(signer).sign_join(request, leader)
        if "signature" in fields:  # a forged one, beside the genuine key
            request.signature = fields["signature"]
    return request


def declare(mm: Matchmaker, peer_id: bytes, **fields: Any) -> None:
    """What the made-up peer's own signed declaration would have told the leader's poll."""
    r = signed_join(peer_id, **fields)
    decl = Declaration(r.endpoint, r.schema_hash, r.client_mode, r.data_endpoint, r.weight,
                       r.bandwidth)
    mm.book.absorb({peer_id: SubRecord(decl.pack(), 1, 10.0)})


# --- the Join stream -----------------------------------------------------------------------
def test_join_answers_every_code() -> None:
    """A leader driven by hand (it never polls, so nothing changes under the test), asked
    over gRPC: every JoinCode the protocol defines, with its suggested leader where due."""
    async def scenario(nodes: list[MoshpitNode]) -> None:
        (node,) = nodes
        pool = ChannelPool()

        def join_request(peer_id: bytes, key: str = "k", **fields: Any) -> pb.JoinRequest:
            return signed_join(peer_id, key, leader=node.peer_id, **fields)

        async def answer(request: pb.JoinRequest) -> pb.JoinResponse:
            call = pool.join(node.grpc_endpoint, request, timeout=5)
            try:
                return await call.read()
            finally:
                call.cancel()

        async def accepted(request: pb.JoinRequest) -> Any:
            call = pool.join(node.grpc_endpoint, request, timeout=10)
            assert (await call.read()).code == pb.ACCEPTED
            return call

        try:
            none_yet = await answer(join_request(pid(1)))
            assert none_yet.code == pb.NOT_LOOKING and "'k'" in none_yet.message
            mm = matchmaker(node, target=3, weight=2.0)
            mm.leading.open()  # as between its declaration and its first poll
            # the daemon routes Join by key: under a key it does not match for, nobody looks
            assert (await answer(join_request(pid(1), key="other"))).code == pb.NOT_LOOKING
            # so WRONG_KEY is the Matchmaker's own guard, reachable only by calling it
            wrong = [r async for r in mm.handle_join(join_request(pid(1), key="other"))]
            assert [r.code for r in wrong] == [pb.WRONG_KEY] and "'k'" in wrong[0].message
            refusals: list[tuple[dict[str, Any], int]] = [
                ({"protocol_version": PROTOCOL_VERSION + 1}, pb.PROTOCOL_MISMATCH),
                ({"peer_id": b"short"}, pb.BAD_REQUEST),
                ({"endpoint": ""}, pb.BAD_REQUEST),
                ({"data_endpoint": ""}, pb.BAD_REQUEST),
                ({"data_endpoint": "no-port"}, pb.BAD_REQUEST),  # members could not connect
                ({"data_endpoint": "127.0.0.1:x"}, pb.BAD_REQUEST),
                ({"data_endpoint": "127.0.0.1:0"}, pb.BAD_REQUEST),
                ({"data_endpoint": ":5000"}, pb.BAD_REQUEST),
                ({"weight": math.nan}, pb.BAD_REQUEST),
                ({"weight": -1.0}, pb.BAD_REQUEST),
                ({"bandwidth": math.inf}, pb.BAD_REQUEST),
                ({"schema_hash": b"\x00" * 32}, pb.BAD_SCHEMA),
                ({"codec": "fp16"}, pb.BAD_SCHEMA),
                ({"peer_id": node.peer_id}, pb.DUPLICATE_PEER),  # the leader itself
                ({"peer_id": b"\x07" * 20}, pb.UNAUTHENTICATED),  # no key of ours: unsigned
                ({"weight": 5.0, "signature": b"\x00" * 64}, pb.UNAUTHENTICATED),
            ]
            for fields, code in refusals:
                got = await answer(join_request(**{"peer_id": pid(1), **fields}))
                assert got.code == code, (fields, pb.JoinCode.Name(got.code), got.message)
            assert not mm.leading.followers  # nothing refused was taken in
            # a joiner must be as it declared itself, signed, under the key (it did not
            # declare at all; it declared another weight; its weight is 1e13 times the rest)
            low = spare_key(lambda p: p < node.peer_id)  # joiners whose keys the test holds
            high = spare_key(lambda p: p > node.peer_id)
            declare(mm, high, weight=3.0)
            declare(mm, pid(2), weight=4.0)
            declare(mm, pid(4), weight=2e13)
            for request, why in ((join_request(pid(1)), "no signed declaration"),
                                 (join_request(pid(2), weight=5.0), "weight differ"),
                                 (join_request(pid(4), weight=2e13), "more than 1e+12 apart")):
                got = await answer(request)
                assert got.code == pb.BAD_REQUEST and why in got.message, got
            assert not mm.leading.followers
            # two peers asking each other at once: the lower peer id leads, on both sides
            mm.leading.asking = low
            crossed = await answer(join_request(low))
            assert crossed.code == pb.NOT_LOOKING and "lower peer id" in crossed.message
            mm.leading.asking = high
            first = await accepted(join_request(high, weight=3.0))
            mm.leading.asking = None
            assert (await answer(join_request(high))).code == pb.DUPLICATE_PEER
            second = await accepted(join_request(pid(2), weight=4.0))
            full = await answer(join_request(pid(3)))
            assert full.code == pb.GROUP_FULL and "3 members" in full.message
            # we join another leader: our followers are released toward it
            boss = Candidate(pid(9), Declaration("127.0.0.1:9", SCHEMA), time.monotonic() + 5, 1)
            mm.leading.follow(boss)
            assert not mm.leading.accepting and not mm.leading.followers
            got = [await first.read(), await second.read(), await answer(join_request(pid(3)))]
            assert [(pb.JoinCode.Name(r.code), r.suggested_leader, r.suggested_leader_id)
                    for r in got] == [(code, "127.0.0.1:9", pid(9)) for code in (
                        "DISBANDED", "DISBANDED", "NOT_A_LEADER")]  # followers, newcomer
            mm.leading.unfollow(reopen=False)  # that leader let us go between attempts
            assert (await answer(join_request(pid(3)))).code == pb.NOT_LOOKING
            # the next attempt fills up and assembles: each follower gets the same group
            mm.leading.open()
            first = await accepted(join_request(high, weight=3.0))
            second = await accepted(join_request(pid(2), weight=4.0))
            group = mm.leading.assemble()
            for call in (first, second):
                done = await call.read()
                assert done.code == pb.GROUP_ASSEMBLED
                assert Group.from_proto(done.group_info) == group
            assert [(m.peer_id, m.weight) for m in group.members] == [
                (node.peer_id, 2.0), (high, 3.0), (pid(2), 4.0)]
            assert group.key == "k" and group.schema_hash == SCHEMA
            assert (await answer(join_request(pid(3)))).code == pb.NOT_LOOKING
        finally:
            await pool.close()

    run_nodes(1, scenario)
