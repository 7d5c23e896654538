"""Lookups among silent nodes: a step goes on once one node has answered, and the silent ones
are left out of the answer, where kademlia's own crawler waits for every one of them."""

from __future__ import annotations

import asyncio
from typing import Any

from kademlia.crawling import NodeSpiderCrawl
from kademlia.node import Node

from moshpitd.dht.crawl import BriskNodeCrawl, settle


def node(i: int) -> Node:
    return Node(i.to_bytes(20, "big"), "127.0.0.1", 1000 + i)


class Swarm:
    """Nodes 1..n; the odd ones (or those named) never answer (a killed peer, a throw-away
    identity): their calls stay pending until the test ends. Every live node knows every
    node."""

    def __init__(self, n: int, silent: set[int] | None = None) -> None:
        self.nodes = [node(i) for i in range(1, n + 1)]
        self.quiet = silent
        self.asked: list[int] = []
        self.silent: list[asyncio.Future[Any]] = []

    async def call_find_node(self, peer: Node, target: Node) -> tuple[bool, Any]:
        self.asked.append(peer.long_id)
        if (peer.long_id % 2 if self.quiet is None else peer.long_id in self.quiet):
            wait = asyncio.get_running_loop().create_future()
            self.silent.append(wait)
            return await wait
        return True, [(n.id, n.ip, n.port) for n in self.nodes]


def test_a_lookup_among_silent_nodes_finishes_with_the_live_ones() -> None:
    async def body() -> None:
        swarm = Swarm(12)
        target = node(0)
        start = [swarm.nodes[0], swarm.nodes[1]]  # one silent, one live
        found = await asyncio.wait_for(BriskNodeCrawl(swarm, target, start, 20, 3).find(), 10)
        assert sorted(n.long_id for n in found) == list(range(2, 13, 2))
        assert set(swarm.asked) == set(range(1, 13))  # everyone was asked once
        # kademlia's crawler, the same lookup: it waits on the silent nodes' calls for ever
        # (in a daemon, a whole RPC timeout per step)
        stuck = asyncio.ensure_future(NodeSpiderCrawl(Swarm(12), target, start, 20, 3).find())
        done, _ = await asyncio.wait([stuck], timeout=0.5)
        assert not done
        stuck.cancel()
        for f in swarm.silent:
            f.cancel()

    asyncio.run(body())


def test_a_step_asking_only_silent_nodes_waits_a_few_answers_long() -> None:
    """Once node 8 has answered, the nodes nearest the key are 1-3, all silent: that step is
    over after a few times node 8's answer took, not after their calls end (never, here)."""
    async def body() -> None:
        swarm = Swarm(12, silent={1, 2, 3})
        crawl = BriskNodeCrawl(swarm, node(0), [swarm.nodes[7]], 20, 3)
        found = await asyncio.wait_for(crawl.find(), 10)
        assert sorted(n.long_id for n in found) == list(range(4, 13))
        assert {1, 2, 3} <= set(swarm.asked)
        for f in swarm.silent:
            f.cancel()

    asyncio.run(body())


def test_settle_waits_for_its_share_and_keeps_stragglers_running() -> None:
    async def body() -> None:
        late = asyncio.get_running_loop().create_future()

        async def answer(x: int) -> int:
            return x

        async def straggler() -> int:
            return await late

        got = await asyncio.wait_for(settle([answer(1), straggler(), answer(3)], need=2), 10)
        assert got == [1, None, 3]
        assert await asyncio.wait_for(settle([], need=1), 1) == []
        # the straggler was not cancelled (that would cancel what it awaits): its call ends
        # on its own terms
        assert not late.done()
        late.set_result(2)

    asyncio.run(body())
