"""A DHT request whose datagram is lost is sent again before its RPC times out."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from kademlia.node import Node
from kademlia.utils import digest

from moshpitd.auth import SwarmKey
from moshpitd.dht.network import DHTNode
from moshpitd.dht.resend import FLOOR, RESENDS


class Lossy:
    """A socket transport that drops the next `drop` datagrams it is asked to send."""

    def __init__(self, inner: Any, drop: int) -> None:
        self.inner, self.drop, self.dropped = inner, drop, 0

    def sendto(self, data: bytes, addr: Any) -> None:
        if self.dropped < self.drop:
            self.dropped += 1
            return
        self.inner.sendto(data, addr)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def _pair(timeout: float) -> tuple[DHTNode, DHTNode]:
    key = SwarmKey(os.urandom(32))
    a, b = DHTNode(rpc_timeout=timeout, auth=key), DHTNode(rpc_timeout=timeout, auth=key)
    await a.start("127.0.0.1", 0)
    await b.start("127.0.0.1", 0)
    return a, b


def _ping(a: DHTNode, b: DHTNode) -> Any:
    port = b.transport.get_extra_info("sockname")[1]
    return a.protocol.ping(("127.0.0.1", port), a.node.id)


def test_a_lost_request_is_sent_again_and_answered_within_its_timeout() -> None:
    async def main() -> None:
        a, b = await _pair(timeout=1.0)
        try:
            # the first copy of the request never leaves (its sealed bytes dropped)
            out = a.protocol.transport
            out.inner = Lossy(out.inner, drop=1)
            ok, answer = await _ping(a, b)
            assert ok and answer == b.node.id  # without a resend, rpcudp gives up at 1 s
            assert a.protocol.rpcs["sent", "any", "resent"] == 1
            # answered at once: the next ping samples a round trip, and the timeout shrinks
            # from a quarter of the RPC timeout towards the floor
            ok, _ = await _ping(a, b)
            assert ok
            addr = ("127.0.0.1", b.transport.get_extra_info("sockname")[1])
            assert a.protocol.resender.rto(addr) == FLOOR
            assert a.protocol.rpcs["sent", "any", "resent"] == 1  # nothing late, nothing resent
        finally:
            a.stop()
            b.stop()

    asyncio.run(main())


def test_copies_are_bounded_and_a_silent_peer_still_times_out() -> None:
    async def main() -> None:
        a, b = await _pair(timeout=0.4)
        try:
            out = a.protocol.transport
            out.inner = Lossy(out.inner, drop=1 + RESENDS)  # every copy lost
            ok, _ = await _ping(a, b)
            assert not ok
            assert out.inner.dropped == 1 + RESENDS
            assert a.protocol.rpcs["sent", "any", "resent"] == RESENDS
            assert not a.protocol.resender._sent  # nothing held for the dead call
        finally:
            a.stop()
            b.stop()

    asyncio.run(main())


def test_a_resent_store_is_taken_once() -> None:
    """The copy of a request that did arrive (its answer was what got lost) reaches the
    handler twice: a store of the same record is idempotent."""

    async def main() -> None:
        a, b = await _pair(timeout=1.0)
        try:
            back = b.protocol.transport
            back.inner = Lossy(back.inner, drop=1)  # b's first answer is lost
            port = b.transport.get_extra_info("sockname")[1]
            b_node = Node(b.node.id, "127.0.0.1", port)
            version = a.next_version()
            proof = a.sign_sub("k", b"v", 30.0, version)
            stored = await a.protocol.call_store_sub(b_node, digest("k"), a.peer_id, b"v",
                                                     version, 30.0, proof)
            assert stored
            assert a.protocol.rpcs["sent", "any", "resent"] == 1
            assert b.protocol.rpcs["received", "store_sub", "ok"] == 2
            assert list(b.storage.signed(digest("k"))) == [a.peer_id]
        finally:
            a.stop()
            b.stop()

    asyncio.run(main())
