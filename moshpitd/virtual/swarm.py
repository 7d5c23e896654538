"""Daemons (MoshpitNode, unchanged) on a virtual network, and their rounds.

Each peer is a host with its own link and clock, running one node: the DHT, matchmaking,
leading and joining, the butterfly round, deadlines and sessions are the daemon's own code.
What stays outside: gRPC (control.py carries the same calls), the IPC socket and trainers
(a round is `MoshpitNode.average` on a numpy vector), the metrics server, NAT checks (every
host is public), and the loop-lag watch (a virtual loop never lags).
"""

from __future__ import annotations

import asyncio
import types
from dataclasses import dataclass, field
from typing import Any

import kademlia.routing
import numpy as np

from moshpitd import identity, timebase
from moshpitd.allreduce.layout import TensorSpec
from moshpitd.auth import SwarmKey
from moshpitd.matchmaking.grid import Grid
from moshpitd.node import MoshpitNode
from moshpitd.node_config import NodeConfig
from moshpitd.rounds import AverageRequest, AverageResult
from moshpitd.virtual.control import virtual_plane
from moshpitd.virtual.net import Host, Link, Network

# kademlia's routing table dates its buckets itself: on its own clock, lonely buckets would
# never be refreshed in virtual time
kademlia.routing.time = types.SimpleNamespace(monotonic=timebase.monotonic)


@dataclass
class Peer:
    index: int
    host: Host
    node: MoshpitNode
    vector: np.ndarray[Any, np.dtype[np.float32]]
    results: list[AverageResult | BaseException] = field(default_factory=list)


class Swarm:
    """Peers that bootstrap from the first one, each averaging its own float32 vector."""

    def __init__(self, net: Network, elems: int, key: SwarmKey | None = None,
                 **options: Any) -> None:
        self.net = net
        self.elems = elems
        self.key = key
        self.options = options
        self.peers: list[Peer] = []
        self.boot: tuple[tuple[str, int], ...] = ()
        self._count = 0
        identity.MEMO = {}  # the same records are checked by every node: once is enough here

    async def add(self, link: Link, vector: np.ndarray[Any, np.dtype[np.float32]],
                  clock_offset: float = 0.0) -> Peer:
        host = self.net.add_host(link, clock_offset)
        config = NodeConfig(dht_listen=(host.ip, 0), grpc_listen=(host.ip, 0), data_port=0,
                            bootstrap=list(self.boot), reachability="public",
                            swarm_key=self.key, **self.options)

        async def start() -> MoshpitNode:
            node = MoshpitNode(config, control=virtual_plane(self.net))
            await node.start()
            if node._lag_task is not None:
                node._lag_task.cancel()  # nothing blocks a virtual loop
            return node
        node = await host.start(start())
        if not self.boot:
            self.boot = ((host.ip, node.dht_addr[1]),)
        peer = Peer(self._count, host, node, vector.astype(np.float32, copy=True))
        self._count += 1
        self.peers.append(peer)
        return peer

    def average(self, peer: Peer, key: str, timeout: float, grid: Grid | None = None,
                group_size: int = 16, min_group_size: int = 2,
                initial_coords: tuple[int, ...] | None = None, after: float = 0.0
                ) -> asyncio.Task[Any]:
        """One round of `peer` (in its host's context), `after` s from now: its vector is
        averaged in place."""
        spec = TensorSpec("float32", (self.elems,), 0)
        request = AverageRequest(key, (spec,), timeout=timeout,
                                 group_size=grid.size if grid else group_size,
                                 min_group_size=min_group_size, grid=grid, rounds=1,
                                 initial_coords=initial_coords)

        async def run() -> None:
            await asyncio.sleep(after)
            try:
                buffer = memoryview(peer.vector.view(np.uint8))  # type: ignore[arg-type]
                peer.results.append(await peer.node.average(request, buffer))
            except Exception as exc:  # a failed round is data: the report counts it
                peer.results.append(exc)
        return peer.host.start(run())

    async def leave(self, peer: Peer) -> None:
        """A peer's process dies (no drain): its connections reset, its tasks end."""
        peer.host.kill()
        self.peers.remove(peer)

    async def stop(self) -> None:
        for peer in self.peers:
            await peer.host.start(peer.node.stop())
        identity.MEMO = None
