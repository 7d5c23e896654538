"""Direct paths to a private peer: it dials the members that would reach it through its relay.

A private daemon can open connections, just not take them. So at the start of each round it
owns a span in, a relayed daemon opens a connection to each other member's data port and
offers it (a REVERSE step, signed by its peer key for that member, naming its advertised data
endpoint). The member keeps the offer, and its next stream to that endpoint and peer id runs
on it, with the usual signed handshake, instead of going through the relay; the stream's
connection is then kept as a session like any other, so later rounds stay direct. Any NAT
allows this, port-preserving or random-port: only the private side dials. Two private peers
still meet through a relay (the offer would reach the other through its own relay).

An offer is used within OFFER_LIFE (the offering side drops a connection that carries no
stream after 10 s), at most one per peer and MAX_OFFERS in all are held, and an offer is kept
only if the peer has no direct session with us already (otherwise its relayed sessions are
dropped in favour of the offer). An offer proves only that its signer made it: a member that
replays one it saw gets a stream whose handshake fails, which costs the stream its round, as
a dead connection would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from moshpitd import timebase
from moshpitd.auth import SwarmKey
from moshpitd.identity import PeerKey, peer_id_of, verify
from moshpitd.nat import wire
from moshpitd.transport.dataplane import Channel, split_endpoint
from moshpitd.transport.session import SessionPool

log = logging.getLogger(__name__)

OFFER_EVERY = 8.0  # s between offers to one member
OFFER_LIFE = 8.0  # s an offer is good for (the offering side waits 10 s for a HELLO)
MAX_OFFERS = 64
DIAL_TIMEOUT = 3.0
MAX_DIALING = 64


def _signed(target: bytes, endpoint: str, stamp: float) -> bytes:
    return b"moshpit/reverse\0" + target + endpoint.encode() + b"\0" + repr(stamp).encode()


class Reversal:
    def __init__(self, key: PeerKey, swarm: SwarmKey | None, pool: SessionPool[Channel],
                 clock: Callable[[], float] = timebase.monotonic) -> None:
        self.key, self.swarm, self.pool, self.clock = key, swarm, pool, clock
        # (their advertised data endpoint, their id) -> (the connection they opened, when)
        self.offers: OrderedDict[tuple[str, bytes], tuple[Channel, float]] = OrderedDict()
        self.offered: dict[bytes, float] = {}  # member -> when we last offered it a path
        self.dialing = 0
        self.taken = 0  # streams that ran on an offer
        self.refused: Counter[str] = Counter()
        self._tasks: set[asyncio.Task[None]] = set()

    # --- the member's side ------------------------------------------------------------------
    def on_offer(self, channel: Channel, payload: bytes) -> None:
        """A REVERSE step: the first frame of a connection a private peer opened to us."""
        try:
            body = wire.parse(self.swarm, wire.REVERSE, payload)
            public, target, endpoint, stamp, signature = body
            if not (isinstance(public, bytes) and isinstance(endpoint, str)
                    and isinstance(stamp, float) and isinstance(signature, bytes)
                    and target == self.key.peer_id and len(endpoint) <= 300):
                raise wire.RelayError("malformed offer")
            if abs(timebase.wall() - stamp) > wire.SIGNED_WINDOW:
                raise wire.RelayError("offer signed too long ago")
            split_endpoint(endpoint)
            if not verify(public, signature, _signed(target, endpoint, stamp)):
                raise wire.RelayError("offer not signed by the key it names")
        except (wire.RelayError, ValueError, TypeError) as exc:
            self.refused["malformed"] += 1
            log.debug("refused a direct-path offer: %s", exc)
            channel.abort("refused")
            return
        peer = peer_id_of(public)
        assert channel.transport is not None
        here = channel.transport.get_extra_info("peername")
        ip = here[0] if here else ""
        kept = []
        while (old := self.pool.take(endpoint, peer)) is not None:
            kept.append(old)
        direct = [c for c in kept if _ip(c) == ip]
        for c in kept:
            if direct:
                self.pool.keep(endpoint, c)  # a direct session already: nothing to gain
            else:
                c.close()  # relayed sessions make way for the direct path
        if direct:
            self.refused["direct"] += 1
            channel.abort("a direct session exists")
            return
        channel.sink = None
        channel.transport.pause_reading()  # nothing to read until our stream starts
        previous = self.offers.pop((endpoint, peer), None)
        if previous is not None:
            previous[0].close()
        self.offers[endpoint, peer] = (channel, self.clock())
        while len(self.offers) > MAX_OFFERS:
            _, (oldest, _) = self.offers.popitem(last=False)
            oldest.close()

    def has(self, endpoint: str, peer_id: bytes) -> bool:
        offer = self.offers.get((endpoint, peer_id))
        return offer is not None and offer[0].is_open() and \
            self.clock() - offer[1] <= OFFER_LIFE

    def take(self, endpoint: str, peer_id: bytes) -> Channel | None:
        """The offered connection for a stream to that peer at that endpoint, or None."""
        offer = self.offers.pop((endpoint, peer_id), None)
        if offer is None:
            return None
        channel, since = offer
        if not channel.is_open() or self.clock() - since > OFFER_LIFE:
            channel.close()
            return None
        assert channel.transport is not None
        channel.transport.resume_reading()
        self.taken += 1
        return channel

    # --- the private peer's side -------------------------------------------------------------
    def offer(self, endpoint: str, members: Sequence[tuple[bytes, str]],
              data: Callable[[], Channel]) -> None:
        """Offer each member a connection to us, our advertised data endpoint `endpoint`."""
        now = self.clock()
        for peer, their in members:
            if (peer == self.key.peer_id or self.offered.get(peer, -OFFER_EVERY) + OFFER_EVERY
                    > now or self.dialing >= MAX_DIALING):
                continue
            self.offered[peer] = now
            if len(self.offered) > 4 * MAX_OFFERS:
                self.offered = {p: t for p, t in self.offered.items() if t + OFFER_EVERY > now}
            task = asyncio.ensure_future(self._offer(peer, their, endpoint, data))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _offer(self, peer: bytes, their: str, endpoint: str,
                     data: Callable[[], Channel]) -> None:
        stamp = timebase.wall()
        body: list[Any] = [self.key.public, peer, endpoint, stamp,
                           self.key.sign(_signed(peer, endpoint, stamp))]
        self.dialing += 1
        try:
            host, port = split_endpoint(their)
            async with asyncio.timeout(DIAL_TIMEOUT):
                transport, _ = await asyncio.get_running_loop().create_connection(
                    data, host, port)  # we take the stream on it as its owner
            transport.write(wire.frame(self.swarm, wire.REVERSE, body))
        except (OSError, TimeoutError, ValueError) as exc:
            log.debug("no direct path to %s at %s: %r", peer.hex()[:12], their, exc)
        finally:
            self.dialing -= 1

    async def close(self) -> None:
        for channel, _ in self.offers.values():
            channel.close()
        self.offers.clear()
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._tasks, return_exceptions=True)


def _ip(channel: Channel) -> str:
    if channel.transport is None:
        return ""
    peer = channel.transport.get_extra_info("peername")
    return str(peer[0]) if peer else ""
