"""DHT nodes on real UDP sockets: records stored through one node are read through another."""

from __future__ import annotations

import asyncio
import time

import pytest

from moshpitd.dht.network import DHTError, DHTNode, normalise_host


async def make_swarm(n: int) -> list[DHTNode]:
    nodes = []
    for i in range(n):
        node = DHTNode(rpc_timeout=0.5)
        _host, _port = await node.start("127.0.0.1", 0)
        if nodes:
            # bootstrap by name, as a user would
            first = nodes[0].transport.get_extra_info("sockname")
            assert await node.join([("localhost" if i % 2 else "127.0.0.1", first[1])]) >= 1
        nodes.append(node)
    return nodes


def test_store_through_one_read_through_another() -> None:
    async def scenario() -> None:
        nodes = await make_swarm(8)
        try:
            a, b, x = nodes[0].peer_id, nodes[3].peer_id, nodes[2].peer_id
            stored = await nodes[0].store_sub("run1/0", a, b"hello", ttl=5.0)
            assert stored >= 2
            await nodes[3].store_sub("run1/0", b, b"world", ttl=5.0)
            subs = await nodes[7].get_subs("run1/0")
            assert {k: v.value for k, v in subs.items()} == {a: b"hello", b: b"world"}
            assert all(0 < v.ttl <= 5.0 for v in subs.values())
            # a withdrawal outranks the declaration everywhere
            await nodes[0].withdraw_sub("run1/0", a)
            subs = await nodes[5].get_subs("run1/0")
            assert set(subs) == {b}
            # records expire by their relative TTL
            stored = time.monotonic()
            await nodes[2].store_sub("short", x, b"v", ttl=0.3)
            assert set(await nodes[6].get_subs("short")) == {x}
            while await nodes[6].get_subs("short"):
                assert time.monotonic() - stored < 3.0, "a 0.3 s record outlived 3 s"
                await asyncio.sleep(0.01)
            assert time.monotonic() - stored >= 0.3, "the record expired before its TTL"
            # a node writes under its own id only: records are signed by their writer
            with pytest.raises(DHTError, match="peer id"):
                await nodes[1].store_sub("run1/0", a, b"forged", ttl=5.0)
            # a record signed for longer than a kind of record lives is not taken
            await nodes[4].store_sub("kind", nodes[4].peer_id, b"v", ttl=60.0)
            assert set(await nodes[6].get_subs("kind", max_ttl=120.0)) == {nodes[4].peer_id}
            assert await nodes[6].get_subs("kind", max_ttl=30.0) == {}
        finally:
            for node in nodes:
                node.stop()

    asyncio.run(scenario())


def test_lone_node_stores_locally_and_bootstrap_failure_is_reported() -> None:
    async def scenario() -> None:
        node = DHTNode(rpc_timeout=0.2)
        await node.start("127.0.0.1", 0)
        try:
            assert await node.store_sub("k", node.peer_id, b"v", ttl=5.0) == 1
            assert set(await node.get_subs("k")) == {node.peer_id}
            # nothing listens on port 9 on loopback: no contacts, no exception
            assert await node.join([("127.0.0.1", 9)]) == 0
        finally:
            node.stop()

    asyncio.run(scenario())


def test_ipv4_mapped_addresses_are_normalised() -> None:
    assert normalise_host("::ffff:127.0.0.1") == "127.0.0.1"
    assert normalise_host("::1") == "::1"
    assert normalise_host("example.org") == "example.org"
