"""Kademlia protocol with subkey RPCs and a settable reply timeout.

Every handler validates its arguments: a datagram from the network is untrusted, and a bad one
must cost a log line, never a crashed task or a poisoned table.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from typing import Any

import msgpack
from kademlia.node import Node
from kademlia.protocol import KademliaProtocol
from kademlia.utils import digest

from moshpitd import timebase
from moshpitd.auth import OVERHEAD, AuthError, ReplayCache, ReplayFull, SwarmKey
from moshpitd.buckets import Bucket, lru_bucket
from moshpitd.dht.answered import Answered
from moshpitd.dht.clients import CLIENT_REQUEST, REPLY, REQUEST, NatRPCs, Outgoing, from_client
from moshpitd.dht.records import Proof, RecordVerifier, remaining
from moshpitd.dht.resend import Resender
from moshpitd.dht.sieve import Sieve
from moshpitd.dht.storage import StoredSub, SubkeyStorage
from moshpitd.dht.welcome import Welcome, consume

log = logging.getLogger(__name__)

MAX_DATAGRAM = 65507
DEPARTED_SECONDS = 60.0
MISSES_TO_DROP = 2
ID_BYTES = 20
# Writers this node holds nothing of and has not proven, whose records one address may bring
# a second (and at once): throw-away identities cost nothing, and each record is a signature
# check (a member storing 3,500 a second from one address kept each daemon's loop a fifth busy
# verifying them). An honest address brings its own daemons' writers, and a replica's handover
# the key's, a few hundred at most. Past it, a store is refused before its signature is checked.
NEW_WRITERS_RATE = 32.0
NEW_WRITERS_BURST = 512
NEW_WRITERS = "new_writers"  # reason label of moshpitd_dht_records_refused_total
# What find_subs may answer with: a datagram, less its seal, header (21) and map (16). Each
# row costs its bytes plus at most ROW_BYTES of msgpack framing (a list, two ints or floats,
# three byte-string headers and the proof's list and float).
REPLY_ROOM = MAX_DATAGRAM - OVERHEAD - 21 - 16
ROW_BYTES = 48
OWN_ID_LOG_EVERY = 60.0  # seconds between errors about one address that holds our peer key
OWN_ID_LOG_ADDRESSES = 64
# Copies of each record: the writer's own, plus one on each of the REPLICAS nodes closest to
# its key. Every lookup and every store asks those nodes, so each costs 2 * REPLICAS datagrams
# whatever the swarm's size (kademlia's k = 20 made every store in a swarm of 16 reach all 15
# others). Records here live seconds (declarations) or are rewritten every round (grid-run
# entries), so three holders outlast the failures a round must survive.
REPLICAS = 3


def _address(sender: object) -> object:
    return sender[0] if isinstance(sender, tuple) else sender


def _is_id(value: object) -> bool:
    return isinstance(value, bytes) and len(value) == ID_BYTES


class SubkeyProtocol(NatRPCs, Welcome, KademliaProtocol):
    storage: SubkeyStorage
    resender: Resender  # set once the socket is open (connection_made)
    sieve: Sieve | None = None  # the socket's kernel filter (dht/sieve.py), with a swarm key

    def __init__(
        self, source_node: Node, storage: SubkeyStorage, ksize: int, wait_timeout: float,
        auth: SwarmKey | None = None, verifier: RecordVerifier | None = None,
        replicas: int = REPLICAS,
    ) -> None:
        super().__init__(source_node, storage, ksize)
        self.replicas = replicas
        self._wait_timeout = wait_timeout
        self.auth = auth
        self.verifier = verifier or RecordVerifier()
        self.replay = ReplayCache(group_of=_address)  # a sender: (address, port)
        self.malformed = 0
        # (direction, rpc, result) -> count, read by the metrics collector at scrape time
        self.rpcs: Counter[tuple[str, str, str]] = Counter()
        self.departed: dict[bytes, float] = {}  # said goodbye -> until when we ignore it
        self._misses: dict[bytes, int] = {}  # contact -> unanswered RPCs in a row
        self.answered = Answered()  # contacts that earned trust (dht/answered.py)
        self.init_welcome()
        self._newcomers: OrderedDict[str, Bucket] = OrderedDict()  # address -> its bucket
        # requests naming our own node id that we did not send: another daemon holds our key
        self.own_id_elsewhere = 0
        self._own_id_logged: dict[tuple[str, int], float] = {}

    # --- datagram handling: never let a peer's bytes raise inside an unowned task ----------
    def connection_made(self, transport: Any) -> None:
        # with a swarm key every datagram we send, request or reply, leaves sealed; a client's
        # requests leave marked (dht/clients.py)
        out = Outgoing(transport, self.auth, self)
        self.resender = Resender(out.send, self._outstanding, self._wait_timeout, self.rpcs)
        super().connection_made(out)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if self.auth is not None:
            try:
                data = self.auth.open(b"dht", b"dht", data, self.replay, addr)
            except AuthError as exc:
                self.rpcs["received", "any", "unauthenticated"] += 1
                if isinstance(exc, ReplayFull) and self.sieve is not None:
                    self.sieve.refused(exc.scope, addr)
                log.debug("dropped a datagram from %s: %s", addr, exc)
                return
        task = asyncio.ensure_future(self._safe_solve(data, addr))
        task.add_done_callback(consume)

    async def _safe_solve(self, datagram: bytes, address: tuple[str, int]) -> None:
        if len(datagram) < 22 or datagram[:1] not in (REQUEST, REPLY, CLIENT_REQUEST):
            self.malformed += 1
            return
        msg_id = datagram[1:21]
        try:
            # msgpack's C decoder: a reply may carry a key's hundreds of records, and
            # rpcudp's pure-Python umsgpack spent ~0.8 ms on 150 of them (40 us here); the
            # encoding is the same (bytes as bin, str as str)
            data = msgpack.unpackb(datagram[21:], raw=False, strict_map_key=False)
        except Exception:  # msgpack raises many types on garbage
            self.malformed += 1
            log.debug("undecodable datagram from %s", address)
            return
        if datagram[:1] == REPLY:
            if msg_id in self._outstanding:
                self.resender.answered(msg_id, address)
                self._accept_response(msg_id, data, address)
            return
        if not (isinstance(data, list) and len(data) == 2 and isinstance(data[0], str)):
            self.malformed += 1
            return
        name, args = data
        from_client.set(datagram[:1] == CLIENT_REQUEST)  # this task's: never our contact
        if (isinstance(args, list | tuple) and args and args[0] == self.source_node.id
                and msg_id not in self._outstanding):
            self._own_id_from(address, name)
        func = getattr(self, f"rpc_{name}", None)
        if func is None or not isinstance(args, list | tuple):
            self.malformed += 1
            self.rpcs["received", "unknown", "malformed"] += 1
            return
        try:
            response = func(address, *args)
            if asyncio.iscoroutine(response):
                response = await response
        except Exception as exc:  # a handler rejecting bad arguments
            self.malformed += 1
            self.rpcs["received", name, "malformed"] += 1
            log.debug("bad rpc_%s from %s: %r", name, address, exc)
            return
        self.rpcs["received", name, "ok"] += 1
        reply = b"\x01" + msg_id + msgpack.packb(response, use_bin_type=True)
        if len(reply) > MAX_DATAGRAM - OVERHEAD:
            log.warning("reply to rpc_%s for %s is too large (%d bytes)", name, address, len(reply))
            return
        if self.transport is not None:
            self.transport.sendto(reply, address)

    def _own_id_from(self, address: tuple[str, int], name: str) -> None:
        """A request that names our node id but is none of ours (those are in _outstanding,
        however they loop back): a second daemon runs with this daemon's peer key. Kademlia
        would silently drop it as a contact; the operator needs to hear of it, once a minute
        per address at most."""
        self.own_id_elsewhere += 1
        now = timebase.monotonic()
        if self._own_id_logged.get(address, -OWN_ID_LOG_EVERY) + OWN_ID_LOG_EVERY > now:
            return
        if len(self._own_id_logged) >= OWN_ID_LOG_ADDRESSES:
            self._own_id_logged.clear()
        self._own_id_logged[address] = now
        here = self.transport.get_extra_info("sockname") if self.transport else None
        log.error("another daemon uses this daemon's peer key: a %s request from %s:%d names "
                  "our peer id %s, and this daemon is at %s; give each daemon its own "
                  "peer_key_file", name, address[0], address[1], self.source_node.id.hex(),
                  f"{here[0]}:{here[1]}" if here else "an unbound socket")

    # --- subkey RPCs --------------------------------------------------------------------------
    def rpc_store_sub(
        self, sender: tuple[str, int], nodeid: bytes, key: bytes, subkey: bytes,
        value: bytes, version: int, ttl: float, proof: list[Any],
    ) -> bool:
        if not (_is_id(nodeid) and _is_id(key) and isinstance(subkey, bytes)
                and isinstance(value, bytes) and isinstance(version, int)
                and isinstance(ttl, int | float) and not isinstance(ttl, bool)):
            raise ValueError("malformed store_sub")
        self.welcome_if_new(Node(nodeid, sender[0], sender[1]))
        # Our own records are ours to write; a record anyone else wrote must be signed by the
        # peer whose id is its subkey (checked last: a signature costs the most)
        if subkey == self.source_node.id or not self.storage.admissible(
                key, subkey, value, version, float(ttl)):
            return False
        if not self._known_writer(subkey, sender[0]):
            self.verifier.refused[NEW_WRITERS] += 1
            return False
        checked = self.verifier.check(key, subkey, value, version, float(ttl), proof)
        if checked is None:
            return False
        return self.storage.store_sub(key, subkey, value, version,
                                      remaining(version, checked, float(ttl)), checked)

    def _known_writer(self, writer: bytes, address: str) -> bool:
        """Whether a record of `writer` from `address` may be checked: a writer stored here or
        proven, or one of the new writers its address may bring (NEW_WRITERS_RATE)."""
        if self.storage.holds_writer(writer) or self.storage.protected(writer):
            return True
        now = self.storage.clock()
        bucket = lru_bucket(self._newcomers, address,
                            lambda: Bucket(NEW_WRITERS_RATE, NEW_WRITERS_BURST, now))
        return bucket.take(1, now)

    def rpc_find_subs(self, sender: tuple[str, int], nodeid: bytes, key: bytes) -> dict[str, Any]:
        if not (_is_id(nodeid) and _is_id(key)):
            raise ValueError("malformed find_subs")
        self.welcome_if_new(Node(nodeid, sender[0], sender[1]))
        return {"subs": self._rows_that_fit(self.storage.signed(key))}

    def _rows_that_fit(self, records: dict[bytes, tuple[StoredSub, float]]) -> list[list[Any]]:
        """As many records as one reply datagram holds: a key full of throw-away identities'
        records is larger than that. Proven writers' first (storage.protected), then our DHT
        contacts' (a replica restarted a moment ago has proven nobody, but knows the daemons
        it talks to), then the others, the latest stored first."""
        protected, contact = self.storage.protected, self.is_contact
        order = sorted(reversed(records.items()),
                       key=lambda item: (not protected(item[0]), not contact(item[0])))
        rows, room = [], REPLY_ROOM
        for sk, (s, ttl) in order:
            if s.proof is None:
                continue
            room -= ROW_BYTES + len(sk) + len(s.value) + len(s.proof.public) + \
                len(s.proof.signature)
            if room < 0:
                break
            rows.append([sk, s.value, s.version, ttl, s.proof.wire()])
        return rows

    def is_contact(self, node_id: bytes) -> bool:
        """In our table, and answered us (a request's free node id earns no trust)."""
        return node_id in self.answered and not self.router.is_new_node(Node(node_id))

    def rpc_leave(self, sender: tuple[str, int], nodeid: bytes) -> bool:
        """A draining daemon says goodbye, so we stop routing to it now rather than after
        timeouts. Only the contact at the sender's own address is dropped."""
        if not _is_id(nodeid):
            raise ValueError("malformed leave")
        for contact in [n for b in self.router.buckets for n in b.get_nodes()]:
            if contact.id == nodeid and (contact.ip, contact.port) == (sender[0], sender[1]):
                self.router.remove_contact(contact)
                # a late reply from it must not re-add it; ids are fresh per daemon start
                now = timebase.monotonic()
                self.departed = {k: t for k, t in self.departed.items() if t > now}
                if len(self.departed) < 10_000:
                    self.departed[bytes(nodeid)] = now + DEPARTED_SECONDS
                return True
        return False

    async def call_leave(self, node: Node) -> bool:
        result = await self.leave((node.ip, node.port), self.source_node.id)
        return bool(result[0])

    # stock RPCs, hardened against wrong types
    def rpc_ping(self, sender: tuple[str, int], nodeid: bytes) -> bytes:
        if not _is_id(nodeid):
            raise ValueError("malformed ping")
        return super().rpc_ping(sender, nodeid)

    def rpc_store(self, sender: tuple[str, int], nodeid: bytes, key: bytes, value: object) -> bool:
        if not (_is_id(nodeid) and _is_id(key)) or not isinstance(value, int | float | str | bytes):
            raise ValueError("malformed store")
        return super().rpc_store(sender, nodeid, key, value)

    def rpc_find_node(self, sender: tuple[str, int], nodeid: bytes, key: bytes) -> list[Any]:
        if not (_is_id(nodeid) and _is_id(key)):
            raise ValueError("malformed find_node")
        return super().rpc_find_node(sender, nodeid, key)

    def rpc_find_value(self, sender: tuple[str, int], nodeid: bytes, key: bytes) -> Any:
        if not (_is_id(nodeid) and _is_id(key)):
            raise ValueError("malformed find_value")
        return super().rpc_find_value(sender, nodeid, key)

    async def call_store_sub(
        self, node: Node, key: bytes, subkey: bytes, value: bytes, version: int, ttl: float,
        proof: Proof,
    ) -> bool:
        result = await self.store_sub(
            (node.ip, node.port), self.source_node.id, key, subkey, value, version, ttl,
            proof.wire()
        )
        self.handle_call_response(result, node)
        return bool(result[0] and result[1] is True)

    async def call_find_subs(self, node: Node, key: bytes) -> list[list[Any]] | None:
        result = await self.find_subs((node.ip, node.port), self.source_node.id, key)
        self.handle_call_response(result, node)
        if not result[0] or not isinstance(result[1], dict):
            return None
        subs = result[1].get("subs")
        return subs if isinstance(subs, list) else None

    def handle_call_response(self, result: Any, node: Node) -> Any:
        """kademlia drops a contact at its first unanswered RPC; one lost datagram on a lossy
        link must not cost a live contact, so it takes MISSES_TO_DROP in a row."""
        self.rpcs["sent", "any", "ok" if result[0] else "timeout"] += 1
        nid = bytes(node.id)
        if result[0]:
            self._misses.pop(nid, None)
            self.answered.add(nid, (node.ip, node.port))
        else:
            if len(self._misses) > 10_000:  # ids that failed once and were never seen again
                self._misses.clear()
            self._misses[nid] = self._misses.get(nid, 0) + 1
            if self._misses[nid] < MISSES_TO_DROP:
                return result
            del self._misses[nid]
            # kademlia logs a warning per dropped contact: a member answering nothing under
            # fresh ids would write thousands a second
            log.debug("no response from %s, removing from router", node)
            self.router.remove_contact(node)
            self.answered.drop(nid)
            return result
        self.welcome(node)
        return result

    def closest(self, node: Node) -> list[Node]:
        """The `replicas` contacts closest to a key. kademlia's find_neighbors stops at the
        first k nodes it walks, in bucket order, so it is asked for a whole bucket's worth and
        the nearest are taken from those."""
        return list(self.router.find_neighbors(node))[:self.replicas]


__all__ = ["SubkeyProtocol", "digest"]
