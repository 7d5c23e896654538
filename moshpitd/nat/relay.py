"""The relay: a public daemon that lets peers behind NAT be reached through it.

A private peer keeps one connection to our data port open (RESERVE, see moshpitd/nat/wire.py).
For it we listen on two ports of our own address, one per port of its own (gRPC, data), and
it advertises those in its declarations. A caller's connection to one of them is announced
to the peer (CONNECT); the peer opens a fresh connection to our data port for it (ACCEPT) and
we splice the two (moshpitd/nat/splice.py). Everything the two daemons say to each other
passes through unchanged: data-plane frames are signed and, when the daemons encrypt, sealed
end to end, and gRPC is as its two ends make it (TLS end to end when the swarm uses TLS).

What we carry is bounded, since identities are free: reservations in all and per address,
connections per reservation, bytes a second per reservation, and a caller that the peer does
not fetch within ACCEPT_WAIT is dropped. A daemon that is not public, or whose operator turned
relaying off, refuses every reservation.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moshpitd import timebase
from moshpitd.auth import ReplayCache, SwarmKey
from moshpitd.nat import wire
from moshpitd.nat.splice import Budget, Half
from moshpitd.transport.dataplane import RELAY, Channel

log = logging.getLogger(__name__)

ACCEPT_WAIT = 5.0  # s a caller waits for the private peer to fetch its connection
MAX_UNREAD = 64 << 10  # bytes of our answers a reserved peer may leave unread


@dataclass(frozen=True)
class RelayLimits:
    reservations: int = 16  # private peers at once
    per_address: int = 4  # of them from one address (peers behind one NAT share it)
    connections: int = 64  # relayed connections of one reservation at once
    per_caller: int = 16  # of them from one caller's address (a stranger's flood of callers
    # must not hold every slot of a reservation)
    rate: float = 12.5e6  # bytes/s one reservation's connections move, both ways; 0: no bound


@dataclass(eq=False)
class _Reservation:
    peer_id: bytes
    address: str
    control: Channel
    budget: Budget
    token: bytes = field(default_factory=lambda: os.urandom(16))
    servers: list[asyncio.Server] = field(default_factory=list)
    pending: dict[int, Half] = field(default_factory=dict)  # callers the peer has not fetched
    live: set[Half] = field(default_factory=set)
    serial: int = 0
    closed: bool = False


class RelayServer:
    """Reservations for private peers. `willing` says whether we relay now (public, and the
    operator allows it); `tamper` is the fault tests' hook into relayed data-plane bytes."""

    def __init__(self, host: str, peer_id: bytes, swarm: SwarmKey | None,
                 limits: RelayLimits, willing: Callable[[], bool],
                 tamper: Callable[[bytes], bytes] | None = None,
                 clock: Callable[[], float] = timebase.monotonic) -> None:
        self.host, self.peer_id, self.swarm = host, peer_id, swarm
        self.limits, self.willing, self.tamper, self.clock = limits, willing, tamper, clock
        self.replay = ReplayCache()
        self.by_token: dict[bytes, _Reservation] = {}
        self.by_peer: dict[bytes, _Reservation] = {}
        self.bytes = 0  # relayed, both directions, all reservations
        self.connections = 0  # relayed connections spliced so far
        self.refused: Counter[str] = Counter()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def reservations(self) -> int:
        return len(self.by_token)

    def _count(self, n: int) -> None:
        self.bytes += n

    def reserve(self, channel: Channel, payload: bytes) -> None:
        """A RESERVE on a fresh connection to our data port. Nothing more is read from it
        until the reservation is made (its next steps go to the reservation's own sink)."""
        channel.sink = None
        if channel.transport is not None:
            channel.transport.pause_reading()
        task = asyncio.ensure_future(self._reserve(channel, payload))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _refuse(self, channel: Channel, why: str, reason: str) -> None:
        self.refused[reason] += 1
        log.debug("relay: refused a reservation (%s)", why)
        if channel.transport is not None and not channel.transport.is_closing():
            channel.transport.write(wire.frame(self.swarm, wire.REFUSE, why))
            channel.transport.close()

    async def _reserve(self, channel: Channel, payload: bytes) -> None:
        assert channel.transport is not None
        peer = channel.transport.get_extra_info("peername")
        address = str(peer[0]) if peer else "?"
        if not self.willing():  # before any signature is checked
            return self._refuse(channel, "this daemon does not relay now", "unwilling")
        try:
            peer_id = wire.reserver(wire.parse(self.swarm, wire.RESERVE, payload, self.replay,
                                               address), self.peer_id)
        except wire.RelayError as exc:
            return self._refuse(channel, str(exc), "malformed")
        old = self.by_peer.get(peer_id)  # the peer reserves again (it restarted, or lost us)
        others = [r for r in self.by_token.values() if r is not old]
        if len(others) >= self.limits.reservations:
            return self._refuse(channel, "this relay is full", "full")
        if sum(r.address == address for r in others) >= self.limits.per_address:
            return self._refuse(channel, "too many reservations from this address",
                                "per_address")
        if old is not None:
            self._close(old)
        res = _Reservation(peer_id, address, channel,
                           Budget(self.limits.rate, self.clock, self._count))
        self.by_token[res.token], self.by_peer[peer_id] = res, res
        try:
            loop = asyncio.get_running_loop()
            for kind in (wire.GRPC, wire.DATA):
                res.servers.append(await loop.create_server(
                    functools.partial(self._inbound, res, kind), self.host, 0))
        except OSError as exc:
            self._close(res)
            return self._refuse(channel, f"no port for it: {exc.strerror}", "ports")
        if not channel.is_open():
            self._close(res)
            return
        ports = [int(s.sockets[0].getsockname()[1]) for s in res.servers]
        channel.sink = _Control(self, res)
        assert channel.transport is not None
        channel.transport.resume_reading()
        channel.transport.write(wire.frame(self.swarm, wire.RESERVED,
                                           [res.token, *ports, address]))
        log.info("relay: reserved ports %s for peer %s at %s", ports, peer_id.hex()[:12],
                 address)

    def _inbound(self, res: _Reservation, kind: int) -> Half:
        tamper = self.tamper if kind == wire.DATA else None
        half = Half(res.budget, tamper=tamper,
                    on_made=lambda made: self._announce(res, kind, made))
        half.on_close = lambda: self._gone(res, half)
        return half

    @staticmethod
    def _gone(res: _Reservation, half: Half) -> None:
        res.live.discard(half)
        if res.pending.get(half.serial) is half:
            del res.pending[half.serial]

    def _announce(self, res: _Reservation, kind: int, half: Half) -> None:
        if half.transport is None or half.transport.is_closing():
            return
        peer = half.transport.get_extra_info("peername")
        origin = half.origin = str(peer[0]) if peer else "?"
        callers = [h for h in (*res.live, *res.pending.values()) if h.origin == origin]
        if (res.closed or len(res.live) + len(res.pending) >= self.limits.connections
                or len(callers) >= self.limits.per_caller):
            self.refused["connections"] += 1
            half.close()
            return
        res.serial += 1
        n = half.serial = res.serial
        res.pending[n] = half
        assert res.control.transport is not None
        res.control.transport.write(wire.frame(self.swarm, wire.CONNECT, [n, kind, origin]))
        asyncio.get_running_loop().call_later(ACCEPT_WAIT, self._unfetched, res, n)

    def _unfetched(self, res: _Reservation, n: int) -> None:
        half = res.pending.pop(n, None)
        if half is not None:
            self.refused["unfetched"] += 1
            half.close()

    def accept(self, channel: Channel, payload: bytes) -> None:
        """An ACCEPT on a fresh connection: splice it to the caller it names."""
        assert channel.transport is not None
        try:
            body = wire.parse(self.swarm, wire.ACCEPT, payload)
            token, n = body
            res = self.by_token[token]
            caller = res.pending.pop(n)
        except (wire.RelayError, ValueError, TypeError, KeyError):
            self.refused["accept"] += 1
            channel.transport.abort()
            return
        if caller.transport is None or caller.transport.is_closing():  # it left meanwhile
            channel.transport.abort()
            return
        half = Half(res.budget, tamper=caller.tamper)
        half.transport = channel.transport
        half.on_close = lambda: self._gone(res, half)
        channel.sink = None
        channel.transport.set_protocol(half)
        res.live.update((half, caller))
        half.join(caller)
        self.connections += 1

    def _close(self, res: _Reservation) -> None:
        if res.closed:
            return
        res.closed = True
        if self.by_token.get(res.token) is res:
            del self.by_token[res.token]
        if self.by_peer.get(res.peer_id) is res:
            del self.by_peer[res.peer_id]
        for server in res.servers:
            server.close()
        for half in [*res.pending.values(), *res.live]:
            half.close()
        res.pending.clear()
        res.live.clear()
        if res.control.transport is not None:
            res.control.transport.close()
        log.info("relay: reservation of peer %s closed", res.peer_id.hex()[:12])

    def close_all(self) -> None:
        """We no longer relay (we turned private, or were told not to)."""
        for res in list(self.by_token.values()):
            self._close(res)

    async def close(self) -> None:
        self.close_all()
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*self._tasks, return_exceptions=True)


class _Control:
    """The sink of a reservation's kept connection: pings, and its end."""

    def __init__(self, relay: RelayServer, res: _Reservation) -> None:
        self.relay, self.res = relay, res

    def buffer_for(self, kind: int, part: int, length: int, aux: int) -> memoryview | None:
        if kind != RELAY or aux != wire.PING:
            raise wire.RelayError(f"unexpected relay step {aux} on a reservation")
        return None

    def on_frame(self, kind: int, part: int, payload: memoryview, aux: int) -> None:
        transport = self.res.control.transport
        if transport is None or transport.is_closing():
            return
        if transport.get_write_buffer_size() > MAX_UNREAD:  # pings it does not read: gone
            self.relay._close(self.res)
            return
        transport.write(wire.frame(None, wire.PONG, b""))

    def on_close(self, exc: BaseException | None) -> None:
        self.relay._close(self.res)


def status(relay: RelayServer) -> dict[str, Any]:
    return {"reservations": relay.reservations, "bytes": relay.bytes,
            "connections": relay.connections, "refused": dict(relay.refused)}
