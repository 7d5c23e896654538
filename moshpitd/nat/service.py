"""A daemon's NAT life: find out whether it is reachable, relay for others when it is, be
relayed when it is not.

`Nat.run` checks reachability (moshpitd/nat/reach.py) once the DHT has contacts, again every
RECHECK, and sooner while the answer is unknown. On "private" it becomes a DHT client
(dht/clients.py) and keeps a reservation at the fastest public peer that offers one
(moshpitd/nat/tunnel.py), advertising the relay's ports as its own; until it holds one, it takes
part in rounds as a client (it contributes and receives, reduces nothing). On "public" it
relays for others, unless its operator said not to (moshpitd/nat/relay.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from kademlia.node import Node

from moshpitd import timebase
from moshpitd.allreduce.group import Group
from moshpitd.auth import SwarmKey
from moshpitd.dht.network import DHTNode
from moshpitd.identity import PeerKey
from moshpitd.nat import wire
from moshpitd.nat.reach import PRIVATE, PUBLIC, UNKNOWN, DialBack, Reachability, Verdict, nonce_of
from moshpitd.nat.relay import RelayLimits, RelayServer, status
from moshpitd.nat.reverse import Reversal
from moshpitd.nat.tunnel import GateServe, Offer, Reserved, Tunnel
from moshpitd.transport.dataplane import Channel
from moshpitd.transport.session import SessionPool

log = logging.getLogger(__name__)

RECHECK = 600.0  # s between checks once known (and whenever a relay is lost)
RETRY_FIRST, RETRY_MAX = 1.0, 30.0  # s between checks while unknown
NO_CONTACTS_POLL = 0.5  # s between looks for a first contact
OFFERS_ASKED = 8  # contacts asked for a relay at once
FAILED_FOR = 30.0  # s a relay that failed us is not asked again
NO_RELAY_WAIT = 2.0  # s before asking again when nobody offers
SETTLE_MAX = 6.0  # s a round waits for a first check in flight


class Nat:
    def __init__(self, mode: str, dht: DHTNode, key: PeerKey, swarm: SwarmKey | None,
                 relay_limits: RelayLimits, relaying: bool,
                 on_endpoints: Callable[[Reserved | None, str], None],
                 tamper: Callable[[bytes], bytes] | None = None) -> None:
        """`on_endpoints(reserved, observed)`: where peers reach us changed (a relay's ports,
        or None: our own, at `observed` if the check found us there)."""
        self.mode, self.dht, self.key, self.swarm = mode, dht, key, swarm
        self.on_endpoints = on_endpoints
        self.reach = Reachability()
        self.dialer = DialBack(swarm)
        self.relaying = relaying
        self.relay = RelayServer("", dht.peer_id, swarm, relay_limits,
                                 lambda: self.relaying and self.state == PUBLIC, tamper)
        self.ports = (0, 0, 0)  # dht, grpc, data
        self.first_pending = False  # a first check is due: we are a client until it says
        self.first_done = asyncio.Event()
        self.reverse: Reversal | None = None
        self.own: tuple[str, ...] = ()
        self.reserved: Reserved | None = None
        # cleared while a daemon told it is private looks for its first relay
        self.first_relay = asyncio.Event()
        self.first_relay.set()
        self._gate: GateServe | None = None
        self._data: Callable[[], Channel] | None = None
        self._task: asyncio.Task[None] | None = None
        self._relayed: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._recheck = asyncio.Event()

    @property
    def state(self) -> str:
        return self.reach.verdict.state

    def start(self, host: str, ports: tuple[int, int, int], gate: GateServe,
              data: Callable[[], Channel], pool: SessionPool[Channel],
              own: tuple[str, ...] = (), accepted: Callable[[], Iterable[Channel]] = tuple
              ) -> None:
        """`own`: the addresses we listen on, and advertise; `pool`: our kept sessions. A
        daemon that has contacts already (it bootstrapped) takes part as a client until its
        first check (`first_pending`): it may be behind NAT, and one that declared an address
        nobody can reach stalled everyone's matchmaking until its declaration expired. It does
        not hold its rounds back: grid rounds start together."""
        self.first_pending = self.mode == "auto" and bool(self.dht.contacts())
        self.ports, self._gate, self._data, self.own = ports, gate, data, own
        self._accepted = accepted  # idle sessions members opened to us
        self.reverse = Reversal(self.key, self.swarm, pool)
        self.relay.host = host  # its reservations' ports: on our own address
        self._task = asyncio.ensure_future(self._run())

    # --- the DHT's NAT requests (dht/clients.py) and the data port's relay steps -------------
    def dial_back(self, sender: tuple[str, int], nonce: bytes, ports: tuple[int, int, int],
                  cookie: bytes) -> bool | bytes:
        if not self.dialer.cookie_ok(sender, cookie):
            return self.dialer.cookie(sender)
        return self.dialer.request(sender, nonce, ports)

    def reached(self, nonce: bytes, kind: str) -> None:
        self.reach.reached(nonce, kind)

    def relay_offer(self) -> list[int] | None:
        if not (self.relaying and self.state == PUBLIC):
            return None
        return [self.ports[2], self.relay.reservations]

    def on_relay_step(self, channel: Channel, op: int, payload: bytes) -> None:
        """The first frame of a connection to our data port was a RELAY step."""
        if op == wire.RESERVE:
            self.relay.reserve(channel, payload)
        elif op == wire.ACCEPT:
            self.relay.accept(channel, payload)
        elif op == wire.REVERSE and self.reverse is not None:
            self.reverse.on_offer(channel, payload)
        else:
            nonce = nonce_of(payload, self.swarm) if op == wire.REACH else None
            if nonce is not None:
                self.reached(nonce, "data")
            channel.abort("not a stream")

    def offer_direct(self, group: Group) -> None:
        """A round of ours starts: while relayed, offer its members direct connections."""
        if self.reserved is None or self.reverse is None or self._data is None:
            return
        relay = self.reserved.relay.host
        direct = {c.session.peer_id for c in self._accepted()  # from last round: no need
                  if c.session is not None and _host(c) not in ("", relay)}
        self.reverse.offer(self.reserved.data, [(m.peer_id, m.data_endpoint)
                                                for m in group.members
                                                if m.peer_id not in direct], self._data)

    # --- checks ---------------------------------------------------------------------------
    async def first_check(self, timeout: float) -> None:
        """Wait (boundedly) for the first verdict of a bootstrapped daemon: at start, before
        it says it is ready, so its first rounds know what it is (on a LAN this is one DHT
        request per contact; behind NAT the dial-backs' wait)."""
        if self.first_pending:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self.first_done.wait()

    async def settled(self) -> None:
        """Wait (boundedly) for the first relay of a daemon told it is private."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(SETTLE_MAX):
                await self.first_relay.wait()

    async def _run(self) -> None:
        if self.mode != "auto":
            if self.mode == PRIVATE:
                self.first_relay.clear()  # rounds wait (boundedly) for the first relay
            self._apply(Verdict(self.mode, "set by the reachability option", "", timebase.wall()))
            return
        retry = RETRY_FIRST
        while True:
            contacts = self.dht.contacts()
            if not contacts:  # a first daemon: check as soon as someone joins
                await asyncio.sleep(NO_CONTACTS_POLL)
                continue
            verdict = await self.reach.check(random.sample(contacts, len(contacts)),
                                             self._ask, self.own)
            self.first_pending = False
            self._apply(verdict)
            self.first_done.set()
            wait = retry if self.state == UNKNOWN else RECHECK
            retry = min(retry * 2, RETRY_MAX) if self.state == UNKNOWN else RETRY_FIRST
            with contextlib.suppress(TimeoutError):  # a lost relay asks again at once
                async with asyncio.timeout(wait):
                    await self._recheck.wait()
            self._recheck.clear()

    async def _ask(self, node: object, nonce: bytes) -> tuple[str, bool] | None:
        assert isinstance(node, Node)
        proto = self.dht.protocol
        cookie = b""
        for _ in range(2):  # the first answer gives our address its cookie
            ok, answer = await proto.reach((node.ip, node.port), proto.source_node.id, nonce,
                                           *self.ports, cookie)
            if not (ok and isinstance(answer, list) and len(answer) == 3
                    and isinstance(answer[0], str)):
                return None
            if answer[0] in self.own:  # no NAT between us: no dial-back needed
                return answer[0], False
            if not isinstance(answer[2], bytes):
                return answer[0], answer[2] is True
            cookie = answer[2][:16]
        return None

    def _apply(self, verdict: Verdict) -> None:
        was, was_verdict = self.state, self.reach.verdict
        if verdict.state == UNKNOWN:
            if was != UNKNOWN:  # a check nobody took: keep what we knew
                self.reach.verdict = was_verdict
                log.info("reachability: still %s (a later check: %s)", was, verdict.why)
            else:  # nobody to ask: take part as the daemon always did
                self.reach.verdict = verdict
                self.on_endpoints(None, "")
            return
        self.reach.verdict = verdict
        if verdict.state != was:
            (log.warning if verdict.state == PRIVATE else log.info)(
                "reachability: %s (%s)", verdict.state, verdict.why)
        proto = self.dht.protocol
        if verdict.state == PRIVATE:
            self.relay.close_all()  # we relay for nobody unless public
        if verdict.state == PRIVATE:
            if not proto.client:
                proto.client = True  # in nobody's table from now: tell our contacts
                self._spawn(self.dht.say_goodbye())
            if self._relayed is None or self._relayed.done():
                self._relayed = asyncio.ensure_future(self._keep_relayed())
        elif verdict.state == PUBLIC:
            if proto.client:
                proto.client = False
                self._spawn(self.dht.bootstrap([(n.ip, n.port) for n in self.dht.contacts()]))
            if self._relayed is not None:
                self._relayed.cancel()
                self._relayed = None
            self.reserved = None
            self.on_endpoints(None, verdict.observed)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- being relayed ----------------------------------------------------------------------
    async def _offers(self, failed: dict[bytes, float]) -> list[Offer]:
        now = timebase.monotonic()
        nodes = [n for n in self.dht.contacts() if failed.get(bytes(n.id), 0.0) < now]
        random.shuffle(nodes)
        proto = self.dht.protocol

        async def ask(node: Node) -> Offer | None:
            start = timebase.monotonic()
            ok, offer = await proto.relay((node.ip, node.port), proto.source_node.id)
            if (ok and isinstance(offer, list) and len(offer) == 2
                    and all(isinstance(x, int) for x in offer) and 0 < offer[0] < 65536):
                return Offer(bytes(node.id), node.ip, offer[0], timebase.monotonic() - start,
                             offer[1])
            return None

        answers = await asyncio.gather(*(ask(n) for n in nodes[:OFFERS_ASKED]))
        # the least loaded first (a relay's link carries its peers' traffic besides its own),
        # then the nearest
        return sorted((a for a in answers if a is not None), key=lambda o: (o.load, o.rtt))

    async def _keep_relayed(self) -> None:
        assert self._gate is not None and self._data is not None
        failed: dict[bytes, float] = {}
        while True:
            offers = await self._offers(failed)
            if not offers:
                self.first_relay.set()  # nothing to wait for
                log.warning("reachability: private, and no public peer offers to relay: "
                            "taking part as a client")
                await asyncio.sleep(NO_RELAY_WAIT)
                continue
            for offer in offers:
                tunnel = Tunnel(self.key, self.swarm, offer, self._gate, self._data)
                try:
                    reserved, reader, writer = await tunnel.reserve()
                except Exception as exc:  # a relay's answer must never end our search
                    log.info("relay %s:%d: no reservation (%s)", offer.host, offer.data_port,
                             exc)
                    failed[offer.peer_id] = timebase.monotonic() + FAILED_FOR
                    continue
                self.reserved = reserved
                log.info("relayed through %s (round trip %.1f ms): peers reach us at %s and %s",
                         offer.host, offer.rtt * 1e3, reserved.grpc, reserved.data)
                self.on_endpoints(reserved, "")
                self.first_relay.set()
                try:
                    why = await tunnel.hold(reader, writer)
                finally:
                    self.reserved = None
                    await tunnel.close()
                self.on_endpoints(None, "")  # not when cancelled: we went public meanwhile
                log.warning("relay %s lost (%s): finding another", offer.host, why)
                self._recheck.set()  # and is our address what it was?
                failed[offer.peer_id] = timebase.monotonic() + FAILED_FOR
                break
            else:  # every offer failed
                self.first_relay.set()
                await asyncio.sleep(NO_RELAY_WAIT)

    def status(self) -> dict[str, Any]:
        v = self.reach.verdict
        return {"state": v.state, "why": v.why, "observed": v.observed,
                "checked_at": v.at, "mode": self.mode,
                "relayed_by": None if self.reserved is None else {
                    "peer_id": self.reserved.relay.peer_id.hex(),
                    "grpc": self.reserved.grpc, "data": self.reserved.data,
                    "rtt_ms": round(self.reserved.relay.rtt * 1e3, 2)},
                "relaying": status(self.relay),
                "direct_offers": None if self.reverse is None else {
                    "held": len(self.reverse.offers), "taken": self.reverse.taken,
                    "refused": dict(self.reverse.refused)}}

    async def close(self) -> None:
        tasks = [t for t in (self._task, self._relayed, *self._background) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.dialer.close()
        await self.relay.close()
        if self.reverse is not None:
            await self.reverse.close()


def _host(channel: Channel) -> str:
    peer = channel.transport.get_extra_info("peername") if channel.transport else None
    return str(peer[0]) if peer else ""
