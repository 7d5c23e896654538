"""The DHT protocol's contact handling: newcomers get the records they should hold, a leaving
peer is dropped, lost replies."""

from __future__ import annotations

import asyncio
import time

import pytest
import umsgpack
from kademlia.node import Node

from moshpitd.dht.records import sign
from tests.unit.dht_fakes import (
    ADDR,
    KEY,
    PEER_ID,
    WRITER_A,
    A,
    B,
    signed,
)
from tests.unit.dht_fakes import in_loop as _in_loop
from tests.unit.dht_fakes import proto as _proto

NOW = time.time_ns()  # record versions are writers' wall clocks in ns: set again per test


@pytest.fixture(autouse=True)
def _versions_from_now() -> None:
    """Versions must lie within the clock window when a test runs, not when it was collected."""
    global NOW
    NOW = time.time_ns()


NEAR_SELF = b"\x00" * 19 + b"\x01"  # distance 1 from the zero key
ZERO_KEY = b"\x00" * 20


def test_newcomer_gets_records_when_table_is_empty() -> None:
    async def body() -> None:
        proto = _proto(NEAR_SELF, transport=True)
        proof = sign(WRITER_A, ZERO_KEY, b"decl", NOW + 4, 20.0)
        proto.storage.store_sub(ZERO_KEY, A, b"decl", NOW + 4, 20.0, proof)
        proto.storage.store_sub(ZERO_KEY, B, b"unsigned", NOW, 20.0)  # never handed on
        newcomer = b"\x00" * 19 + b"\x02"
        assert proto.rpc_ping(("10.0.0.9", 9), newcomer) == NEAR_SELF
        for _ in range(5):
            await asyncio.sleep(0)
        sent = proto.transport.sent  # type: ignore[union-attr]
        # first a ping of ours; its answer, with the id it claimed, makes it a contact
        (ping, addr), = sent
        assert addr == ("10.0.0.9", 9) and umsgpack.unpackb(ping[21:])[0] == "ping"
        proto.datagram_received(b"\x01" + ping[1:21] + umsgpack.packb(newcomer), addr)
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(sent) == 2
        data, addr = sent[1]
        assert addr == ("10.0.0.9", 9)
        assert data[:1] == b"\x00"
        name, args = umsgpack.unpackb(data[21:])
        assert name == "store_sub"
        # as written: the original version and the writer's signature
        assert list(args) == [NEAR_SELF, ZERO_KEY, A, b"decl", NOW + 4, 20.0, proof.wire()]
        # the reply resolves the outstanding call
        msg_id = data[1:21]
        proto.datagram_received(b"\x01" + msg_id + umsgpack.packb(True), addr)
        for _ in range(5):
            await asyncio.sleep(0)
        assert msg_id not in proto._outstanding

    _in_loop(body)


def test_records_go_to_close_newcomer_only() -> None:
    async def body() -> None:
        proto = _proto(NEAR_SELF, transport=True)
        far = b"\xf0" + b"\x00" * 19
        proto.welcome(Node(far, "10.0.0.1", 1))  # table: one far contact, storage empty
        proto.storage.store_sub(ZERO_KEY, A, b"decl", NOW, 20.0,
                                sign(WRITER_A, ZERO_KEY, b"decl", NOW, 20.0))
        sent = proto.transport.sent  # type: ignore[union-attr]

        proto.welcome(Node(b"\xff" * 20, "10.0.0.2", 2))  # farther than the far contact
        for _ in range(5):
            await asyncio.sleep(0)
        assert sent == []

        proto.welcome(Node(b"\x00" * 19 + b"\x03", "10.0.0.3", 3))  # closer than the far one
        for _ in range(5):
            await asyncio.sleep(0)
        assert [addr for _, addr in sent] == [("10.0.0.3", 3)]
        assert umsgpack.unpackb(sent[0][0][21:])[0] == "store_sub"

        proto.welcome(Node(b"\x00" * 19 + b"\x03", "10.0.0.3", 3))  # known now: nothing more
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(sent) == 1

    _in_loop(body)


def test_leave_drops_the_contact_and_keeps_it_out() -> None:
    proto = _proto()
    other = (b"\x05" * 20, ("10.0.0.5", 4005))

    async def body() -> None:
        proto.welcome(Node(PEER_ID, *ADDR))
        proto.welcome(Node(other[0], *other[1]))
        assert len(proto.router.find_neighbors(Node(KEY))) == 2
        # a goodbye claiming another peer's id from the wrong address removes nothing
        assert proto.rpc_leave(ADDR, other[0]) is False
        assert proto.rpc_leave(other[1], PEER_ID) is False
        assert proto.rpc_leave(ADDR, PEER_ID) is True
        assert [n.id for n in proto.router.find_neighbors(Node(KEY))] == [other[0]]
        proto.rpc_ping(ADDR, PEER_ID)  # a late datagram from it does not bring it back
        proto.welcome(Node(PEER_ID, *ADDR))  # ...nor a late answer
        assert [n.id for n in proto.router.find_neighbors(Node(KEY))] == [other[0]]
        assert not proto._probing  # not even probed
        with pytest.raises(ValueError):
            proto.rpc_leave(ADDR, b"short")
        assert proto.rpcs == {}  # direct calls are not counted; datagrams are

    _in_loop(body)


def test_one_lost_reply_keeps_the_contact_two_drop_it() -> None:
    proto = _proto()

    async def body() -> None:
        proto.welcome(Node(PEER_ID, *ADDR))
        node = Node(PEER_ID, *ADDR)
        proto.handle_call_response((False, None), node)
        assert not proto.router.is_new_node(node)  # one lost datagram: still a contact
        proto.handle_call_response((True, PEER_ID), node)
        proto.handle_call_response((False, None), node)
        assert not proto.router.is_new_node(node)  # an answer in between reset the count
        proto.handle_call_response((False, None), node)
        assert proto.router.is_new_node(node)  # two in a row: dropped
        assert proto.rpcs[("sent", "any", "timeout")] == 3

    _in_loop(body)


def test_a_node_that_only_sent_requests_is_no_trusted_contact_until_it_answers() -> None:
    """Kademlia puts any request's sender in its table, and node ids cost nothing: a flood of
    made-up ids once made each a 'contact', whose records a replica answers first and whose
    declarations matchmaking probes first. Only an answer to a call of ours earns that."""
    proto = _proto()

    async def body() -> None:
        assert proto.rpc_store_sub(ADDR, PEER_ID, *signed(WRITER_A, b"v", NOW, 30.0))
        assert proto.router.is_new_node(Node(PEER_ID))  # probed first (dht/welcome.py)
        assert not proto.is_contact(PEER_ID)
        proto.handle_call_response((True, PEER_ID), Node(PEER_ID, *ADDR))
        assert proto.is_contact(PEER_ID)
        # an answer proves the address, not the id: one trusted id per address, the last
        other = b"\x05" * 20
        proto.handle_call_response((True, other), Node(other, *ADDR))
        assert proto.is_contact(other) and not proto.is_contact(PEER_ID)
        for _ in range(2):  # dropped after two silent calls: no contact either, even when
            proto.handle_call_response((False, None), Node(other, *ADDR))
        assert proto.rpc_store_sub(ADDR, other, *signed(WRITER_A, b"w", NOW + 1, 30.0))
        assert proto.router.is_new_node(Node(other))  # probed again before it is routed to
        assert not proto.is_contact(other)

    _in_loop(body)
