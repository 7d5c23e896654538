"""The relay's pieces on loopback in one process: a reservation, callers spliced to the private
peer's connections in both directions, the bounds, and a relay that goes away."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from moshpitd.auth import SwarmKey
from moshpitd.identity import PeerKey
from moshpitd.nat import wire
from moshpitd.nat.relay import RelayLimits, RelayServer
from moshpitd.nat.reverse import Reversal
from moshpitd.nat.tunnel import Offer, Tunnel
from moshpitd.transport.dataplane import RELAY, Channel
from moshpitd.transport.session import SessionPool


class _Port:
    """A data port that hands RELAY steps to the relay, as the registry does."""

    def __init__(self, relay: RelayServer) -> None:
        self.relay = relay
        self.channel: Channel | None = None

    def buffer_for(self, kind: int, part: int, length: int, aux: int) -> memoryview | None:
        assert kind == RELAY
        return None

    def on_frame(self, kind: int, part: int, payload: memoryview, aux: int) -> None:
        assert self.channel is not None
        if aux == wire.RESERVE:
            self.relay.reserve(self.channel, bytes(payload))
        elif aux == wire.ACCEPT:
            self.relay.accept(self.channel, bytes(payload))

    def on_close(self, exc: BaseException | None) -> None:
        pass


async def _relay(swarm: SwarmKey | None = None, limits: RelayLimits | None = None,
                 willing: Callable[[], bool] = lambda: True
                 ) -> tuple[RelayServer, asyncio.Server, Offer]:
    """A relay on loopback behind a data port, and the offer a private peer would get of it."""
    relay_id = PeerKey.generate().peer_id
    relay = RelayServer("127.0.0.1", relay_id, swarm, limits or RelayLimits(), willing)

    def accept() -> Channel:
        port = _Port(relay)
        port.channel = Channel(port)
        return port.channel
    server = await asyncio.get_running_loop().create_server(accept, "127.0.0.1", 0)
    return relay, server, Offer(relay_id, "127.0.0.1", server.sockets[0].getsockname()[1], 0.0)


def _tunnel(offer: Offer, swarm: SwarmKey | None = None) -> Tunnel:
    """A private peer's side, with _Echo as its data plane and _gate as its gate."""
    return Tunnel(PeerKey.generate(), swarm, offer, _gate, _Echo)  # type: ignore[arg-type]


class _Echo(asyncio.Protocol):
    """The private peer's 'data plane': sends back what it gets, upper-cased."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(data.upper())  # type: ignore[attr-defined]


async def _gate(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, origin: str) -> None:
    writer.write(f"gate sees {origin}\n".encode())
    await writer.drain()
    writer.close()


LOOPS = ["asyncio", *(["uvloop"] if importlib.util.find_spec("uvloop") else [])]


def run(coro: Coroutine[Any, Any, None], loop: str) -> None:
    """On the stock loop and on uvloop (what the daemon runs): splicing swaps a transport's
    protocol, which each loop implements on its own."""
    if loop == "uvloop":
        import uvloop
        uvloop.run(asyncio.wait_for(coro, 30))
    else:
        asyncio.run(asyncio.wait_for(coro, 30))


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("swarm", [None, SwarmKey(os.urandom(32))])
def test_callers_reach_the_private_peer_through_its_reservation(
        swarm: SwarmKey | None, loop: str) -> None:
    run(_callers_reach(swarm), loop)


async def _callers_reach(swarm: SwarmKey | None) -> None:
    relay, server, offer = await _relay(swarm)
    tunnel = _tunnel(offer, swarm)
    reserved, reader, writer = await tunnel.reserve()
    held = asyncio.ensure_future(tunnel.hold(reader, writer))
    try:
        host, dport = reserved.data.rsplit(":", 1)
        r, w = await asyncio.open_connection(host, int(dport))
        blob = os.urandom(3 << 20).hex().encode()  # 6 MiB through the splice and back
        w.write(blob)
        got = await asyncio.wait_for(r.readexactly(len(blob)), 10)
        assert got == blob.upper()
        host, gport = reserved.grpc.rsplit(":", 1)
        r2, w2 = await asyncio.open_connection(host, int(gport))
        w2.write(b"x")
        assert (await asyncio.wait_for(r2.readline(), 5)).startswith(b"gate sees relayed:127.")
        assert relay.reservations == 1 and relay.connections == 2
        assert relay.bytes >= 2 * len(blob)
        w.close()
    finally:
        held.cancel()
        await tunnel.close()
        await relay.close()
        server.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_a_reservation_without_the_swarm_key_is_refused(loop: str) -> None:
    run(_a_reservation_without_the_swarm_key_is_refused(), loop)


async def _a_reservation_without_the_swarm_key_is_refused() -> None:
    relay, server, offer = await _relay(SwarmKey(os.urandom(32)))
    tunnel = _tunnel(offer, SwarmKey(os.urandom(32)))
    with pytest.raises((wire.RelayError, asyncio.IncompleteReadError)):
        await tunnel.reserve()
    assert relay.reservations == 0 and relay.refused["malformed"] == 1
    await relay.close()
    server.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_a_full_relay_refuses_and_an_unwilling_one_too(loop: str) -> None:
    run(_a_full_relay_refuses_and_an_unwilling_one_too(), loop)


async def _a_full_relay_refuses_and_an_unwilling_one_too() -> None:
    willing = True
    relay, server, offer = await _relay(limits=RelayLimits(reservations=1),
                                        willing=lambda: willing)
    _, _, w1 = await _tunnel(offer).reserve()
    with pytest.raises(wire.RelayError, match="full"):
        await _tunnel(offer).reserve()
    w1.close()
    await asyncio.wait_for(_until(lambda: relay.reservations == 0), 5)
    willing = False
    with pytest.raises(wire.RelayError, match="does not relay"):
        await _tunnel(offer).reserve()
    assert relay.refused["full"] == 1 and relay.refused["unwilling"] == 1
    await relay.close()
    server.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_the_private_peer_hears_at_once_that_its_relay_went(loop: str) -> None:
    run(_the_private_peer_hears_at_once_that_its_relay_went(), loop)


async def _the_private_peer_hears_at_once_that_its_relay_went() -> None:
    relay, server, offer = await _relay()
    tunnel = _tunnel(offer)
    _, reader, writer = await tunnel.reserve()
    held = asyncio.ensure_future(tunnel.hold(reader, writer))
    await relay.close()
    why = await asyncio.wait_for(held, 3)
    assert "closed" in why
    server.close()


async def _until(cond: object) -> None:
    assert callable(cond)
    while not cond():
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("loop", LOOPS)
def test_relayed_connections_that_end_free_their_slots(loop: str) -> None:
    run(_slots_freed(), loop)


async def _slots_freed() -> None:
    """Callers that finish cleanly, and callers that leave before they are fetched, hold
    nothing: 40 of each through a reservation of 16 slots."""
    relay, server, offer = await _relay(limits=RelayLimits(connections=16, per_caller=16))
    tunnel = _tunnel(offer)
    reserved, reader, writer = await tunnel.reserve()
    held = asyncio.ensure_future(tunnel.hold(reader, writer))
    host, dport = reserved.data.rsplit(":", 1)
    try:
        for _ in range(40):
            r, w = await asyncio.open_connection(host, int(dport))
            w.write(b"ping")
            assert await asyncio.wait_for(r.readexactly(4), 5) == b"PING"
            w.write_eof()
            assert await asyncio.wait_for(r.read(), 5) == b""  # the echo side ends too
            w.close()
            _r2, w2 = await asyncio.open_connection(host, int(dport))
            w2.transport.abort()  # gone before its connection is fetched
        res = next(iter(relay.by_token.values()))
        await asyncio.wait_for(_until(lambda: not res.live and not res.pending), 5)
        assert relay.refused["connections"] == 0
    finally:
        held.cancel()
        await tunnel.close()
        await relay.close()
        server.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_reservations_in_one_write_make_one_reservation(loop: str) -> None:
    run(_one_reservation_per_connection(), loop)


async def _one_reservation_per_connection() -> None:
    relay, server, offer = await _relay()
    r, w = await asyncio.open_connection(offer.host, offer.data_port)
    w.write(b"".join(wire.frame(None, wire.RESERVE,
                                wire.reservation(PeerKey.generate(), offer.peer_id))
                     for _ in range(3)))
    steps = []
    with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
        while True:
            steps.append((await asyncio.wait_for(wire.read_frame(r), 5))[0])
    # one reservation; the steps after it were no pings, so the relay dropped it, and with it
    # its ports: nothing is left behind
    assert steps == [wire.RESERVED]
    await asyncio.wait_for(_until(lambda: relay.reservations == 0 and not relay.by_peer), 5)
    w.close()
    await relay.close()
    server.close()


class _Offers:
    """A member's data port that hands REVERSE steps to its Reversal, as the registry does."""

    def __init__(self, reversal: Reversal) -> None:
        self.reversal = reversal
        self.channel: Channel | None = None

    def buffer_for(self, kind: int, part: int, length: int, aux: int) -> memoryview | None:
        return None

    def on_frame(self, kind: int, part: int, payload: memoryview, aux: int) -> None:
        assert self.channel is not None and aux == wire.REVERSE
        self.reversal.on_offer(self.channel, bytes(payload))

    def on_close(self, exc: BaseException | None) -> None:
        pass


@pytest.mark.parametrize("loop", LOOPS)
def test_a_private_owner_offers_members_a_direct_connection(loop: str) -> None:
    run(_direct_offer(), loop)


async def _direct_offer() -> None:
    owner, member, other = PeerKey.generate(), PeerKey.generate(), PeerKey.generate()
    theirs = Reversal(member, None, SessionPool())

    def accept() -> Channel:
        port = _Offers(theirs)
        port.channel = Channel(port)
        return port.channel
    server = await asyncio.get_running_loop().create_server(accept, "127.0.0.1", 0)
    where = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    ours = Reversal(owner, None, SessionPool())
    ours.offer("198.51.100.1:4242", [(member.peer_id, where), (owner.peer_id, where)],
               lambda: Channel(None))
    ours.offer("198.51.100.1:4242", [(member.peer_id, where)], lambda: Channel(None))
    await asyncio.wait_for(_until(lambda: theirs.has("198.51.100.1:4242", owner.peer_id)), 5)
    assert len(theirs.offers) == 1  # one offer per member per OFFER_EVERY, none to ourselves
    assert not theirs.has("198.51.100.1:4242", other.peer_id)
    channel = theirs.take("198.51.100.1:4242", owner.peer_id)
    assert channel is not None and channel.is_open() and theirs.taken == 1
    channel.close()
    # an offer meant for another member is refused
    forged = Reversal(owner, None, SessionPool())
    forged.offer("198.51.100.1:4242", [(other.peer_id, where)], lambda: Channel(None))
    await asyncio.wait_for(_until(lambda: theirs.refused["malformed"] == 1), 5)
    assert not theirs.offers
    for r in (ours, theirs, forged):
        await r.close()
    server.close()
