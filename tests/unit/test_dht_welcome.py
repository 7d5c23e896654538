"""Who enters the DHT's routing table (a request's sender once it answers a ping), and what a
newcomer is handed (dht/welcome.py)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import umsgpack
from kademlia.node import Node

from moshpitd.dht.network import DHTNode
from moshpitd.dht.welcome import HANDOVER_BURST, MAX_PROBES, PROBES_PER_HOST
from moshpitd.identity import PeerKey
from tests.unit.dht_fakes import ADDR, KEY, PEER_ID, pings, signed
from tests.unit.dht_fakes import in_loop as _in_loop
from tests.unit.dht_fakes import proto as _proto


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_requests_sender_enters_the_table_once_it_answers_a_ping_with_its_id() -> None:
    """Ids cost nothing, and lookups wait for every contact in the table: a flood of records
    under fresh ids once filled the tables with ids that never answer (dht/welcome.py)."""
    async def body() -> None:
        proto = _proto(transport=True)
        proto.rpc_find_subs(ADDR, PEER_ID, KEY)
        proto.rpc_find_subs(ADDR, b"\x06" * 20, KEY)  # another id from the same port: one probe
        await _settle()
        (msg_id, addr), = pings(proto)
        assert addr == ADDR and proto.router.is_new_node(Node(PEER_ID))
        proto.datagram_received(b"\x01" + msg_id + umsgpack.packb(PEER_ID), ADDR)
        await _settle()
        neighbors = proto.router.find_neighbors(Node(KEY))
        assert [(n.id, n.ip, n.port) for n in neighbors] == [(PEER_ID, *ADDR)]
        assert proto.is_contact(PEER_ID)
        # an answer under another id than the one claimed (a spoofed address): not added
        spoofed = ("10.0.0.7", 7)
        proto.rpc_find_subs(spoofed, b"\x07" * 20, KEY)
        await _settle()
        (msg_id, _), = [p for p in pings(proto) if p[1] == spoofed]
        proto.datagram_received(b"\x01" + msg_id + umsgpack.packb(b"\x08" * 20), spoofed)
        await _settle()
        assert proto.router.is_new_node(Node(b"\x07" * 20))
        assert proto.router.is_new_node(Node(b"\x08" * 20))
        assert not proto._probing

    _in_loop(body)


def test_probes_are_bounded_per_host_and_in_total() -> None:
    async def body() -> None:
        proto = _proto(transport=True)
        for port in range(1, 100):  # one host, many ports, each a new id
            proto.rpc_find_subs(("10.0.1.1", port), bytes([9, port]) + b"\x00" * 18, KEY)
        for host in range(1, 100):
            proto.rpc_find_subs((f"10.0.2.{host}", 1), bytes([10, host]) + b"\x00" * 18, KEY)
        await _settle()
        probes = pings(proto)
        assert len(probes) == MAX_PROBES
        assert sum(1 for _, a in probes if a[0] == "10.0.1.1") == PROBES_PER_HOST
        assert proto.probes_skipped == 99 + 99 - MAX_PROBES
        assert DHTNode.rpc_counts(SimpleNamespace(protocol=proto))[  # type: ignore[arg-type]
            "received", "any", "sender_unprobed"] == 99 + 99 - MAX_PROBES
        for task in list(proto._probing.values()):
            task.cancel()
        await _settle()
        assert not proto._probing  # freed when they end

    _in_loop(body)


def test_records_handed_to_new_contacts_are_bounded_per_second() -> None:
    """A newcomer gets the records it should now hold, but over all newcomers at most
    HANDOVER_BURST at once and HANDOVER_RATE a second: a member that filled a key with
    records and showed up under fresh node ids once drew thousands of stores a second to an
    address that never answered."""
    async def body() -> None:
        proto = _proto(bytes([3] * 19 + [1]), transport=True)  # KEY's closest replica
        now = time.time_ns()
        for _ in range(300):  # a full key, every record signed by its own writer
            proto.rpc_store_sub(ADDR, PEER_ID, *signed(PeerKey.generate(), b"d", now, 30.0))
        for i in range(20):  # newcomers, each new and nearer the key than the last
            near = bytes([3] * 18 + [3 ^ (64 - i), 0])
            proto.welcome(Node(near, "10.0.0.9", 5000 + i))
        for _ in range(5):
            await asyncio.sleep(0)
        stores = len(proto.transport.sent)  # type: ignore[union-attr]
        # 256 records (a full key) to each of 20 newcomers, unbounded; + what accrued meanwhile
        assert 0 < stores <= HANDOVER_BURST + 10 < 20 * 256, stores

    _in_loop(body)
