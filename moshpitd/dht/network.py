"""The DHT node the daemon talks to: subkey stores and merged lookups over kademlia."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from kademlia.network import Server
from kademlia.node import Node
from kademlia.utils import digest

from moshpitd import timebase
from moshpitd.auth import OVERHEAD, SwarmKey
from moshpitd.dht.crawl import BriskNodeCrawl, keep_running, settle
from moshpitd.dht.protocol import SubkeyProtocol
from moshpitd.dht.records import Proof, RecordVerifier, remaining, sign
from moshpitd.dht.sieve import Sieve
from moshpitd.dht.storage import SubkeyStorage
from moshpitd.identity import PeerKey

log = logging.getLogger(__name__)

T = TypeVar("T")
NEAREST_CACHE_SECONDS = 10.0
# bytes of datagrams the kernel may queue for the DHT socket (Linux's default is 208 KiB; it
# caps this at net.core.rmem_max): a burst of junk overflows a small buffer, and the kernel
# then drops honest datagrams with it (requests lost that way are sent again: dht/resend.py)
RECEIVE_BUFFER = 4 << 20


@dataclass(frozen=True)
class SubRecord:
    value: bytes
    version: int
    ttl: float  # remaining seconds as seen by the freshest holder


class DHTError(Exception):
    """A DHT operation could not be carried out."""


def normalise_host(host: str) -> str:
    """IPv4-mapped IPv6 addresses name the same peer as their IPv4 form."""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


async def resolve(hostport: tuple[str, int]) -> list[tuple[str, int]]:
    """kademlia takes IP addresses only: resolve names first, to every address they have
    (a headless Kubernetes Service names every daemon of the swarm)."""
    host, port = hostport
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    if not infos:
        raise DHTError(f"cannot resolve bootstrap host {host!r}")
    return list(dict.fromkeys((normalise_host(str(info[4][0])), port) for info in infos))


# Records of writers that have not proven they live (storage.protected) and are not our DHT
# contacts, whose signatures one read checks in each replica's answer: a key flooded by
# throw-away identities would otherwise cost a signature check per record per poll, many polls
# a second (at 64, verifying them took a fifth of a daemon's loop under a flood). Replicas send
# their latest records first, so a newcomer's fresh declaration is among those checked; and a
# newcomer that bootstrapped through us, or that we met in a lookup, is a contact, checked
# whatever the budget.
UNPROVEN_PER_READ = 16


class DHTNode(Server):
    protocol_class = SubkeyProtocol
    protocol: SubkeyProtocol
    storage: SubkeyStorage

    def __init__(
        self, *, rpc_timeout: float, identity: PeerKey | None = None, ksize: int = 20,
        alpha: int = 3, storage: SubkeyStorage | None = None, auth: SwarmKey | None = None,
    ) -> None:
        """`rpc_timeout`: seconds each RPC waits for its answer (the option
        dht_rpc_timeout; rpcudp's own default of 5 s is never used). `identity`: the peer
        key whose id is our node id and which signs our records (a fresh one if None)."""
        self.identity = identity or PeerKey.generate()
        super().__init__(ksize=ksize, alpha=alpha, node_id=self.identity.peer_id,
                         storage=storage or SubkeyStorage())
        self.rpc_timeout = rpc_timeout
        self.auth = auth
        self.verifier = RecordVerifier()
        self._last_version = 0
        self._nearest_cache: dict[bytes, tuple[float, list[Node]]] = {}
        self._crawling: dict[bytes, asyncio.Future[list[Node]]] = {}

    def _create_protocol(self) -> SubkeyProtocol:
        return self.protocol_class(self.node, self.storage, self.ksize, self.rpc_timeout,
                                   self.auth, self.verifier)

    @property
    def peer_id(self) -> bytes:
        return bytes(self.node.id)

    def stop(self) -> None:
        if getattr(self, "protocol", None) is not None:
            self.protocol.stop_probes()
            if self.protocol.sieve is not None:
                self.protocol.sieve.close()
        super().stop()

    def rpc_counts(self) -> Mapping[tuple[str, str, str], int]:
        """The protocol's RPC counts, and what the kernel dropped at its socket (dht/sieve.py),
        read at scrape time."""
        if getattr(self, "protocol", None) is None:
            return {}
        counts = dict(self.protocol.rpcs)
        counts["received", "any", "sender_unprobed"] = self.protocol.probes_skipped
        if self.protocol.sieve is not None:
            counts["received", "any", "dropped_by_kernel"] = self.protocol.sieve.dropped()
        return counts

    async def start(self, host: str, port: int) -> tuple[str, int]:
        await self.listen(port, interface=host)
        sock = self.transport.get_extra_info("socket")
        if sock is not None:  # (a virtual network's has none)
            with contextlib.suppress(OSError):  # the kernel caps it at net.core.rmem_max
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
            if self.auth is not None:  # only sealed datagrams are wanted: see dht/sieve.py
                replay = self.protocol.replay
                self.protocol.sieve = Sieve(sock, OVERHEAD, lambda sender, group: replay.full(
                    sender, group, timebase.wall()))
        bound = self.transport.get_extra_info("sockname")
        return str(bound[0]), int(bound[1])

    async def join(self, addrs: list[tuple[str, int]]) -> int:
        """Bootstrap from host:port pairs; returns how many contacts answered."""
        resolved: list[tuple[str, int]] = []
        for addr in addrs:
            try:
                resolved.extend(await resolve(addr))
            except (OSError, DHTError) as exc:
                log.warning("bootstrap %s:%s: %s", addr[0], addr[1], exc)
        if resolved:
            await self.bootstrap(resolved)
        return self.peer_count()

    async def bootstrap(self, addrs: list[tuple[str, int]]) -> list[Node]:
        """kademlia's bootstrap (ping the addresses, then look ourselves up), neither step
        waiting out a silent node once another has answered."""
        answers = await settle([self.bootstrap_node(addr) for addr in addrs], need=1)
        nodes = [n for n in answers if n is not None]
        spider = BriskNodeCrawl(self.protocol, self.node, nodes, self.ksize, self.alpha)
        found: list[Node] = await spider.find()
        return found

    async def say_goodbye(self, timeout: float = 1.0) -> int:
        """Tell every contact we leave; returns how many heard it."""
        contacts = self.contacts()
        if not contacts:
            return 0
        # not cancelled at the timeout: rpcudp resolves each call itself (cancelling its
        # futures makes its own timeout callback fail)
        tasks = [asyncio.ensure_future(self.protocol.call_leave(n)) for n in contacts]
        done, pending = await asyncio.wait(tasks, timeout=timeout)
        keep_running(pending)
        return sum(1 for t in done if t.exception() is None and t.result() is True)

    def contacts(self) -> list[Node]:
        if self.protocol is None:
            return []
        return [n for b in self.protocol.router.buckets for n in b.get_nodes()]

    def peer_count(self) -> int:
        if self.protocol is None:
            return 0
        return sum(len(b) for b in self.protocol.router.buckets)

    def next_version(self) -> int:
        """Versions order one writer's records; they come from its own clock only."""
        self._last_version = max(self._last_version + 1, timebase.wall_ns())
        return self._last_version

    async def _nearest(self, dkey: bytes) -> list[Node]:
        """The `replicas` nodes closest to a key. A swarm smaller than k is wholly in our
        routing table, so no crawl is needed; otherwise crawl, once for callers at the same
        moment (a declaration's store and the first read of its key), and reuse the answer
        for a while."""
        router = self.protocol.router
        node = Node(dkey)
        if self.peer_count() < self.ksize:
            return self.protocol.closest(node)
        cached = self._nearest_cache.get(dkey)
        now = timebase.monotonic()
        if cached is not None and cached[0] > now:
            return [n for n in cached[1] if not router.is_new_node(n)]  # drop the unreachable
        crawling = self._crawling.get(dkey)
        if crawling is None:
            crawling = asyncio.ensure_future(self._crawl(node))
            self._crawling[dkey] = crawling
            crawling.add_done_callback(lambda _: self._crawling.pop(dkey, None))
        return list(await asyncio.shield(crawling))

    async def _crawl(self, node: Node) -> list[Node]:
        nearest = self.protocol.router.find_neighbors(node)
        if not nearest:
            return []
        spider = BriskNodeCrawl(self.protocol, node, nearest, self.protocol.replicas,
                                self.alpha)
        found: list[Node] = await spider.find()
        self._nearest_cache[bytes(node.id)] = (timebase.monotonic() + NEAREST_CACHE_SECONDS, found)
        if len(self._nearest_cache) > 1024:
            self._nearest_cache.clear()
        return found

    async def _quorum(self, calls: list[Awaitable[T]]) -> list[T | None]:
        """Answers of the calls that came back in time. Once half have answered, stragglers get
        a short extra wait, not the full RPC timeout: a dead node must not stall matchmaking.
        Calls still running keep going in the background (their failure prunes the node)."""
        return await settle(calls, need=(len(calls) + 1) // 2)

    def check_record(self, key: str, subkey: bytes, value: bytes) -> None:
        """Raise DHTError if store_sub would refuse this record (so a caller that stores in
        the background still fails at once)."""
        if subkey != self.peer_id:
            raise DHTError(f"subkey {subkey.hex()} is not this daemon's peer id: a record is "
                           "signed by its writer, so a daemon writes under its own id only")
        if len(value) > self.storage.max_value_bytes:
            raise DHTError(f"a record of {len(value)} bytes under {key!r} exceeds "
                           f"dht_max_value_bytes={self.storage.max_value_bytes}")

    def sign_sub(self, key: str, value: bytes, ttl: float, version: int) -> Proof:
        """Our record's proof, as `store_sub` makes it: its writer may hand it to a peer
        directly (a join carries its declaration, matchmaking/leading.py)."""
        return sign(self.identity, digest(key), value, version, ttl)

    def verify_sub(self, key: str, subkey: bytes, value: bytes, version: int, proof: Proof
                   ) -> SubRecord | None:
        """A record its writer handed us, as a lookup would take it: its signature checked
        (or found verified before), its version plausible by our clock."""
        now = timebase.wall()
        checked = self.verifier.check(digest(key), subkey, value, version, proof.ttl, proof,
                                      now)
        if checked is None:
            return None
        return SubRecord(value, version, remaining(version, checked, proof.ttl, now))

    async def store_sub(self, key: str, subkey: bytes, value: bytes, ttl: float,
                        version: int | None = None, proof: Proof | None = None) -> int:
        """Sign our record and store it on the closest nodes and locally; returns how many
        copies were accepted. Only our own subkey (our peer id) is ours to write. `proof`:
        `sign_sub`'s for this very record, if it was already signed."""
        self.check_record(key, subkey, value)
        dkey = digest(key)
        version = self.next_version() if version is None else version
        if proof is None:
            proof = sign(self.identity, dkey, value, version, ttl)
        stored = int(self.storage.store_sub(dkey, subkey, value, version, ttl, proof))
        nodes = await self._nearest(dkey)
        results = await self._quorum(
            [self.protocol.call_store_sub(n, dkey, subkey, value, version, ttl, proof)
             for n in nodes]
        )
        return stored + sum(1 for r in results if r)

    async def withdraw_sub(self, key: str, subkey: bytes, ttl: float = 30.0,
                           version: int | None = None) -> int:
        """Replace our record by a tombstone that outranks it on every replica. Take `version`
        when the withdrawal is decided if it may run after a newer declaration is made."""
        return await self.store_sub(key, subkey, b"", ttl, version)

    def local_subs(self, key: str, max_ttl: float | None = None, live_only: bool = True
                   ) -> dict[bytes, SubRecord]:
        """The records under `key` that this node holds as a replica (each verified when it
        was stored), with no lookup: every record under keys it is among the closest to."""
        out = {}
        for sk, (rec, ttl) in self.storage.signed(digest(key)).items():
            if rec.proof is not None and (max_ttl is None or rec.proof.ttl <= max_ttl):
                out[sk] = SubRecord(rec.value, rec.version, ttl)
        return {sk: r for sk, r in out.items() if r.value and r.ttl > 0} if live_only else out

    async def get_subs(self, key: str, max_ttl: float | None = None) -> dict[bytes, SubRecord]:
        """Ask every one of the closest nodes and merge (highest version wins per subkey).
        Only records their writers signed are merged. `max_ttl`: the longest lifetime a
        record of this kind has; one signed for longer (a version dated far back that would
        still be alive) is ignored."""
        dkey = digest(key)
        merged: dict[bytes, SubRecord] = self.local_subs(key, max_ttl, live_only=False)

        def merge(sk: bytes, value: bytes, version: int, ttl: float) -> None:
            old = merged.get(sk)
            if old is None or (old.version, old.ttl) < (version, ttl):
                merged[sk] = SubRecord(value, version, ttl)

        nodes = await self._nearest(dkey)
        answers = await self._quorum([self.protocol.call_find_subs(n, dkey) for n in nodes])
        now = timebase.wall()
        protected, contact = self.storage.protected, self.protocol.is_contact
        for answer in answers:  # each replica's answer its own budget: one cannot spend it all
            unproven = UNPROVEN_PER_READ
            for row in answer or []:
                if not (isinstance(row, list) and len(row) == 5):
                    continue
                sk, value, version, ttl, wire = row
                if not (isinstance(sk, bytes) and isinstance(value, bytes)
                        and isinstance(version, int) and isinstance(ttl, int | float)
                        and not isinstance(ttl, bool)):
                    continue
                held = merged.get(sk)
                if held is not None and (held.version > version or (
                        held.version == version and held.value == value)):
                    continue  # older, or the record we hold as another replica sent it
                if not protected(sk) and not contact(sk):
                    if unproven <= 0:
                        continue
                    unproven -= 1
                proof = self.verifier.check(dkey, sk, value, version, float(ttl), wire, now)
                if proof is None or (max_ttl is not None and proof.ttl > max_ttl):
                    continue
                merge(sk, value, version, remaining(version, proof, float(ttl), now))
        return {sk: rec for sk, rec in merged.items() if rec.value and rec.ttl > 0}
