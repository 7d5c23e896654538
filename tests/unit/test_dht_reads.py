"""What a DHT read checks of a key flooded by throw-away identities: a bounded number of
unproven writers' signatures per replica's answer, and, whatever that budget, the records of
proven writers and of the daemon's own DHT contacts (a newcomer that bootstrapped through it)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kademlia.node import Node
from kademlia.utils import digest

from moshpitd.dht.network import UNPROVEN_PER_READ, DHTNode
from moshpitd.dht.records import sign
from moshpitd.identity import PeerKey

KEY = "round-key"


def row(writer: PeerKey, value: bytes, version: int) -> list[Any]:
    proof = sign(writer, digest(KEY), value, version, 30.0)
    return [writer.peer_id, value, version, 30.0, proof.wire()]


def test_a_read_checks_contacts_and_proven_writers_past_the_unproven_budget() -> None:
    async def body() -> None:
        node = DHTNode(rpc_timeout=1.0)
        node.protocol = node._create_protocol()
        now = time.time_ns()
        flood = [PeerKey.generate() for _ in range(3 * UNPROVEN_PER_READ)]
        contact, proven = PeerKey.generate(), PeerKey.generate()
        node.protocol.router.add_contact(Node(contact.peer_id, "127.0.0.1", 4000))
        node.protocol.answered.add(contact.peer_id, ("127.0.0.1", 4000))
        node.storage.protected = {proven.peer_id}.__contains__
        # the replica answers the flood first (its latest records), ours last
        answer = [row(w, b"junk", now) for w in flood]
        answer += [row(contact, b"newcomer", now), row(proven, b"known", now)]
        replica = Node(b"\x09" * 20, "127.0.0.1", 4001)

        async def nearest(dkey: bytes) -> list[Node]:
            return [replica]

        async def find_subs(n: Node, dkey: bytes) -> list[Any]:
            return answer

        node._nearest = nearest  # type: ignore[method-assign]
        node.protocol.call_find_subs = find_subs  # type: ignore[method-assign,assignment]
        checked = node.verifier.verifications
        got = await node.get_subs(KEY)
        assert got[contact.peer_id].value == b"newcomer"
        assert got[proven.peer_id].value == b"known"
        assert sum(v.value == b"junk" for v in got.values()) == UNPROVEN_PER_READ
        assert node.verifier.verifications - checked == UNPROVEN_PER_READ + 2

    asyncio.run(body())
