"""The private peer's side of a relay: a kept reservation, and the connections it fetches.

We hold one reservation at a time, at the public peer with the fewest reservations that
answered our offer request, the fastest of those (moshpitd/nat/service.py asks), and advertise
its two ports as our own gRPC and data endpoints. For each caller it announces we open a fresh
connection to its data port, say ACCEPT, and hand the connection to our own gate (gRPC) or
data plane as if we had accepted it: from there nothing knows it came through a relay. Pings
every PING_EVERY; a relay silent for DEAD_AFTER, or whose connection ends, is replaced at once
by the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from moshpitd.auth import SwarmKey
from moshpitd.identity import PeerKey
from moshpitd.nat import wire
from moshpitd.node_config import format_hostport
from moshpitd.transport.dataplane import Channel

log = logging.getLogger(__name__)

PING_EVERY = 1.0  # s
DEAD_AFTER = 4.0  # s without a frame from the relay
RESERVE_TIMEOUT = 5.0
FETCH_TIMEOUT = 5.0
MAX_FETCHING = 64  # announced callers whose connections are being opened at once


def _port(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536


@dataclass(frozen=True)
class Offer:
    peer_id: bytes
    host: str
    data_port: int
    rtt: float  # s, of the offer request
    load: int = 0  # reservations the relay held when it offered


@dataclass(frozen=True)
class Reserved:
    relay: Offer
    grpc: str  # the endpoints callers dial for us
    data: str


GateServe = Callable[[asyncio.StreamReader, asyncio.StreamWriter, str], Awaitable[None]]


async def no_gate(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, origin: str
                  ) -> None:
    """Where relayed gRPC connections go when the daemon has no gate (none are served)."""
    writer.close()


class Tunnel:
    """One reservation, for as long as the relay keeps it."""

    def __init__(self, key: PeerKey, swarm: SwarmKey | None, offer: Offer, gate: GateServe,
                 data: Callable[[], Channel]) -> None:
        self.key, self.swarm, self.offer, self.gate, self.data = key, swarm, offer, gate, data
        self.token = b""
        self.fetching = 0  # connections being opened for announced callers
        self._tasks: set[asyncio.Task[Any]] = set()

    async def reserve(self) -> tuple[Reserved, asyncio.StreamReader, asyncio.StreamWriter]:
        o = self.offer
        async with asyncio.timeout(RESERVE_TIMEOUT):
            reader, writer = await asyncio.open_connection(o.host, o.data_port)
            try:
                writer.write(wire.frame(self.swarm, wire.RESERVE,
                                        wire.reservation(self.key, o.peer_id)))
                op, payload = await wire.read_frame(reader)
                body = wire.parse(self.swarm, op, payload)
                if op == wire.REFUSE:
                    raise wire.RelayError(f"relay refused: {body}")
                if not (op == wire.RESERVED and isinstance(body, list) and len(body) == 4
                        and isinstance(body[0], bytes) and len(body[0]) == 16
                        and all(_port(p) for p in body[1:3])):
                    raise wire.RelayError(f"malformed relay answer (step {op})")
                self.token, gport, dport, _seen = body
            except BaseException:
                writer.close()
                raise
        return (Reserved(o, format_hostport(o.host, gport), format_hostport(o.host, dport)),
                reader, writer)

    async def hold(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> str:
        """Serve the reservation until the relay goes; why it went."""
        pinger = asyncio.ensure_future(self._ping(writer))
        try:
            while True:
                async with asyncio.timeout(DEAD_AFTER):
                    op, payload = await wire.read_frame(reader)
                if op == wire.CONNECT:
                    if self.fetching >= MAX_FETCHING:  # a relay that announces floods
                        return f"announced over {MAX_FETCHING} callers at once"
                    self._spawn(self._fetch(wire.parse(self.swarm, op, payload)))
                elif op != wire.PONG:
                    return f"unexpected relay step {op}"
        except TimeoutError:
            return f"silent for {DEAD_AFTER:.0f} s"
        except (OSError, asyncio.IncompleteReadError):
            return "its connection closed"
        except wire.RelayError as exc:
            return str(exc)
        finally:
            pinger.cancel()
            writer.close()

    async def _ping(self, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while True:
                writer.write(wire.frame(None, wire.PING, b""))
                await asyncio.sleep(PING_EVERY)

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _fetch(self, body: Any) -> None:
        """Open a connection for the caller the relay announced, and take it as our own."""
        if not (isinstance(body, list) and len(body) == 3):
            return
        n, kind, origin = body
        accept = wire.frame(self.swarm, wire.ACCEPT, [self.token, n])
        host, port = self.offer.host, self.offer.data_port
        self.fetching += 1
        try:  # nothing is said on it before ACCEPT: the relay splices only after it
            async with asyncio.timeout(FETCH_TIMEOUT):
                if kind == wire.DATA:
                    transport, _ = await asyncio.get_running_loop().create_connection(
                        self.data, host, port)
                    transport.write(accept)
                    return
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(accept)
        except (OSError, TimeoutError) as exc:
            log.debug("relay: could not fetch connection %s: %r", n, exc)
            return
        finally:
            self.fetching -= 1
        await self.gate(reader, writer, f"relayed:{origin}")

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
