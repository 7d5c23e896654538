"""Who enters the routing table, and what a newcomer is handed.

Kademlia adds the sender of any request to its table, and a node id costs nothing. Every
contact in the table is one that lookups ask and wait for: a member storing records under a
new identity a datagram (3,000 a second) filled the daemons' tables with ids that never answer,
and their lookups then spent 5,000 resends and 2,500 timeouts in 8 s on them, the matchmaking
of 4 daemons taking 0.11 s a round instead of 0.02 s. So a request's sender enters the table
only once it answers a ping of ours with the id it claimed (one RTT later), and the probes are
bounded: MAX_PROBES in flight, one per address and port (one socket is one node), at most
PROBES_PER_HOST per IP address (peers behind one NAT, and a test's daemons on 127.0.0.1, share
one; the others' next requests are probed later). A sender spoofing another's address draws
one ping to that address, which answers with its own id: not added.

Letting each host's first id in unprobed, as Kademlia would, was tried: one fake contact per
host, dropped after two unanswered calls, still cost 156 resends and 75 timeouts in those 8 s
(64 and 30 with every sender probed), and rounds took 0.13 s (0.11 s). In the simulator (256
peers on internet links, 6 seeds) neither rule moved convergence beyond the spread between
runs, which is wide.

An answer to a call of our own (a lookup's, a store's) proves the same and enters the table at
once (`welcome`), as in Kademlia.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

from kademlia.node import Node

from moshpitd import timebase
from moshpitd.dht.clients import from_client

if TYPE_CHECKING:
    from kademlia.routing import RoutingTable

    from moshpitd.dht.storage import SubkeyStorage

log = logging.getLogger(__name__)

MAX_PROBES = 64
PROBES_PER_HOST = 16
WELCOME_RATE = 5.0  # new contacts per second that get the records they should hold
WELCOME_BURST = 50
# Records per second handed to new contacts, over all of them: a member that shows up under
# fresh node ids beside a key it filled with records once drew thousands of stores a second
# to an address that never answered (each a sealed datagram, each timeout a log line)
HANDOVER_RATE = 200.0
HANDOVER_BURST = 1000


class Welcome:
    """Mixed into the DHT protocol (dht/protocol.py), which provides what is declared here."""

    router: RoutingTable
    storage: SubkeyStorage
    source_node: Node
    departed: dict[bytes, float]
    rpcs: Counter[tuple[str, str, str]]
    ping: Any  # rpcudp's RPC stub: await ping(address, our id) -> (answered, their id)
    if TYPE_CHECKING:
        def handle_call_response(self, result: Any, node: Node) -> Any: ...
        def closest(self, node: Node) -> list[Node]: ...
        async def call_store_sub(self, node: Node, key: bytes, subkey: bytes, value: bytes,
                                 version: int, ttl: float, proof: Any) -> bool: ...

    def init_welcome(self) -> None:
        self._welcome_tokens = float(WELCOME_BURST)
        self._handover_tokens = float(HANDOVER_BURST)
        self._welcome_at = self.storage.clock()
        self._probing: dict[tuple[str, int], asyncio.Task[None]] = {}
        self.probes_skipped = 0  # senders not probed because the bounds were reached

    def _unwanted(self, node: Node) -> bool:
        return (node.id == self.source_node.id or from_client.get()  # ourselves; a NATed client
                or self.departed.get(bytes(node.id), 0.0) > timebase.monotonic()
                or not self.router.is_new_node(node))

    def welcome_if_new(self, node: Node) -> None:
        """A request came from `node`: probe it, and add it once it answers."""
        if self._unwanted(node):
            return
        address = (node.ip, node.port)
        if address in self._probing:
            return
        if len(self._probing) >= MAX_PROBES or sum(
                ip == node.ip for ip, _ in self._probing) >= PROBES_PER_HOST:
            self.probes_skipped += 1
            return
        try:
            task = asyncio.get_running_loop().create_task(self._probe(node))
        except RuntimeError:  # no loop to probe from (a handler called directly)
            return
        self._probing[address] = task
        task.add_done_callback(lambda _: self._probing.pop(address, None))

    async def _probe(self, node: Node) -> None:
        try:
            result = await self.ping((node.ip, node.port), self.source_node.id)
        except Exception as exc:  # (a socket closed under it)
            log.debug("probe of %s failed: %r", node, exc)
            return
        if not result[0]:
            self.rpcs["sent", "any", "timeout"] += 1
        elif result[1] == node.id:
            self.handle_call_response(result, node)
        # else: another node answers there (a spoofed or stale address): not added

    def welcome(self, node: Node) -> None:
        """`node` answered us: add it, and hand it the subkey records it is now among the
        closest holders of."""
        if self._unwanted(node):
            return
        # Handing records over costs a scan of every key: new contacts past a few per second
        # (a flood of made-up node ids) are added without it; owners refresh their records.
        now = self.storage.clock()
        elapsed, self._welcome_at = now - self._welcome_at, now
        self._welcome_tokens = min(WELCOME_BURST, self._welcome_tokens + elapsed * WELCOME_RATE)
        self._handover_tokens = min(HANDOVER_BURST,
                                    self._handover_tokens + elapsed * HANDOVER_RATE)
        if self._welcome_tokens < 1 or self._handover_tokens < 1:
            self.router.add_contact(node)
            return
        self._welcome_tokens -= 1
        for key in self.storage.sub_keys():
            if self._handover_tokens < 1:
                break
            keynode = Node(key)
            neighbors = self.closest(keynode)
            if neighbors:
                new_close = node.distance_to(keynode) < neighbors[-1].distance_to(keynode)
                we_closest = self.source_node.distance_to(keynode) < neighbors[0].distance_to(
                    keynode
                )
            if not neighbors or (new_close and we_closest):
                # as written: original versions and signatures (only the writer can sign)
                for sk, (rec, ttl) in self.storage.signed(key, touch=False).items():
                    if rec.proof is None:
                        continue
                    if self._handover_tokens < 1:
                        break
                    self._handover_tokens -= 1
                    task = asyncio.ensure_future(
                        self.call_store_sub(node, key, sk, rec.value, rec.version, ttl,
                                            rec.proof)
                    )
                    task.add_done_callback(consume)
        self.router.add_contact(node)

    def stop_probes(self) -> None:
        for task in list(self._probing.values()):
            task.cancel()


def consume(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("dht task failed: %r", task.exception())
