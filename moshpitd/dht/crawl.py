"""Lookups that do not wait on the dead.

kademlia's crawler asks alpha nodes at a time and waits for every answer, so each silent node
among them costs a whole RPC timeout, one after another. Routing tables hold silent nodes as a
matter of course: peers killed without a goodbye, and any identity that once sent a request
and went away (free to make). A daemon bootstrapping into a swarm with ten such nodes took ten
seconds to become ready. Here each step waits for its first answer and gives the rest a short
grace, and once some node has answered, a step whose nodes are all silent waits a few times
as long as that answer took; the slow calls go on in the background, and their failure prunes
the routing table as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import Any, TypeVar

from kademlia.crawling import NodeSpiderCrawl

from moshpitd import timebase

T = TypeVar("T")
STRAGGLER_MIN_WAIT = 0.05  # s a straggler gets beyond twice the time the first answers took
_BACKGROUND: set[asyncio.Future[Any]] = set()


def keep_running(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Hold a reference to tasks left to finish in the background (the loop keeps only weak
    ones), until each is done."""
    for t in tasks:
        _BACKGROUND.add(t)
        t.add_done_callback(_BACKGROUND.discard)


async def settle(calls: list[Awaitable[T]], need: int) -> list[T | None]:
    """The calls' results, None for those still running once `need` have finished and the
    rest have had STRAGGLER_MIN_WAIT plus twice as long again. Calls left running keep going
    in the background (an RPC's own timeout ends each)."""
    results, _ = await settle_timed(calls, need)
    return results


async def settle_timed(calls: list[Awaitable[T]], need: int, limit: float | None = None
                       ) -> tuple[list[T | None], float | None]:
    """settle, waiting at most `limit` s for the first `need`; also the seconds they took
    (None if the limit came first)."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    if not tasks:
        return [], None
    start = timebase.monotonic()
    pending = set(tasks)
    took: float | None = None
    while pending and len(tasks) - len(pending) < need:
        left = None if limit is None else limit - (timebase.monotonic() - start)
        if left is not None and left <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=left,
                                        return_when=asyncio.FIRST_COMPLETED)
    else:
        took = timebase.monotonic() - start
        if pending:
            _, pending = await asyncio.wait(pending, timeout=STRAGGLER_MIN_WAIT + 2 * took)
    keep_running(pending)
    return [t.result() if t.done() and not t.cancelled() and t.exception() is None
            else None for t in tasks], took


class BriskNodeCrawl(NodeSpiderCrawl):
    """kademlia's node lookup, each step settled by its first answer (see the module)."""

    last_ids_crawled: list[int]

    def __init__(self, protocol: Any, node: Any, peers: list[Any], ksize: int, alpha: int
                 ) -> None:
        super().__init__(protocol, node, peers, ksize, alpha)
        self.silent: set[bytes] = set()
        # s the slowest first answer of a step took so far: once a node has answered, a later
        # step asking only silent nodes waits a few times that, not an RPC timeout
        self.pace: float | None = None

    async def _find(self, rpcmethod: Any) -> Any:
        count = self.alpha
        if self.nearest.get_ids() == self.last_ids_crawled:  # no progress: ask all the rest
            count = len(self.nearest)
        self.last_ids_crawled = self.nearest.get_ids()
        peers = self.nearest.get_uncontacted()[:count]
        for peer in peers:
            self.nearest.mark_contacted(peer)
        limit = None if self.pace is None else STRAGGLER_MIN_WAIT + 4 * self.pace
        answers, took = await settle_timed([rpcmethod(peer, self.node) for peer in peers],
                                           need=1, limit=limit)
        if took is not None and any(a is not None and a[0] for a in answers):
            self.pace = took if self.pace is None else max(self.pace, took)
        # a straggler counts as silent for this lookup only (its routing table hears of the
        # call's own outcome later); kademlia drops a silent node from the candidates, but the
        # next answer naming it puts it back: it is left out of the result here
        found = {peer.id: (False, None) if answer is None else answer
                 for peer, answer in zip(peers, answers, strict=True)}
        self.silent.update(pid for pid, answer in found.items() if not answer[0])
        nearest = await self._nodes_found(found)
        return [n for n in nearest if n.id not in self.silent]
