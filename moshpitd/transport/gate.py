"""A gate in front of the gRPC port: what a peer may hold before it proves anything.

gRPC offers bounds per connection (streams, message size) and over the whole server (RPCs at
once), but none per address, and it takes every connection it is offered. So the daemon's gRPC
server listens on loopback only, and its public port is this gate: it counts connections per
remote address and in total, refuses one past either bound at once, closes a connection that
sends nothing within `first_bytes` s or does not take our bytes for `stall` s, and copies
bytes through buffers of a fixed size (so a connection holds at most a few of them, whatever
its peer does). The handlers learn the remote address of the connection a call came through
from `origin`, to bound RPCs per address as well.

What peers send is paced too: every request the port serves is under 2 KiB, and an honest
peer sends a few a round, but a member flooding signed joins made each daemon spend a quarter
of a core in gRPC answering them. Before proof, each connection has a token bucket of bytes
(`burst`) that refills at `rate` shared among its address's connections; once it is empty
the gate stops reading from that connection until it refills, and the flood waits in its
sender's own buffers at no cost to us. A connection does not wait for another's debt, so an
honest peer's join from a flooder's address (a NAT, or loopback in tests) still passes. New
connections from one address are paced too (`accept_rate`), or a flooder would open fresh
ones for fresh buckets. A connection whose caller proved its key and that it lives is
`vouch`ed: its bytes are then charged to that identity's bucket (`rate`, `burst`).

Per-address bounds are loose on purpose: tests and benchmarks run many daemons on 127.0.0.1,
and peers behind one NAT share an address. After a peer proves its key (a signed join), the
bounds are per identity (matchmaking/admission.py). TLS passes through untouched: the gate
sees only ciphertext, and gRPC still checks certificates end to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from moshpitd import timebase
from moshpitd.buckets import Bucket, lru_bucket

log = logging.getLogger(__name__)

CHUNK = 32 << 10  # bytes read at once from either side: the buffers a connection may fill
PER_ADDRESS = "per_address"  # `limit` labels of moshpitd_grpc_connections_refused_total
TOTAL = "total"
SILENT = "silent"  # closed: nothing within first_bytes
STALLED = "stalled"  # closed: did not take our bytes within stall
REACH_MAGIC = b"MOSHPIT-REACH/1\n"  # then a 16-byte nonce: a dial-back (moshpitd/nat/reach.py)
PACED = "paced"  # not read from for a while: it sent past its bucket
ACCEPT_RATE = "accept_rate"  # refused: its address opened connections past accept_rate


@dataclass(frozen=True)
class GateLimits:
    per_address: int = 64  # connections from one address at once
    total: int = 1024  # connections at once
    first_bytes: float = 10.0  # s to send the HTTP/2 preface (or the TLS hello)
    stall: float = 30.0  # s our bytes may wait for a peer to take them
    rate: int = 16 << 10  # bytes/s one address's connections (before proof) or identity send
    burst: int = 32 << 10  # bytes one connection (before proof) or identity sends at once
    accept_rate: float = 16.0  # new connections a second from one address
    accept_burst: int = 256  # new connections at once from one address


class _Conn:
    __slots__ = ("address", "bucket", "identity")

    def __init__(self, address: str, bucket: Bucket) -> None:
        self.address = address
        self.bucket = bucket  # its own, before proof
        self.identity: bytes | None = None  # once vouched: whose bucket it is charged to


class Gate:
    """Listens on the public gRPC address and relays each accepted connection to `target`."""

    def __init__(self, target: tuple[str, int], limits: GateLimits = GateLimits(),
                 on_refuse: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = timebase.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        """`clock` and `sleep` pace reads (a test runs them on a virtual clock)."""
        self.target = target
        self.clock, self.sleep = clock, sleep
        self.limits = limits
        self.on_refuse = on_refuse or (lambda why: None)
        self.on_reach: Callable[[bytes], None] = lambda nonce: None
        self.open: Counter[str] = Counter()  # remote address -> connections
        self.refused: Counter[str] = Counter()
        self._origin: dict[int, _Conn] = {}  # our local port towards gRPC -> connection
        self._identities: OrderedDict[bytes, Bucket] = OrderedDict()
        self._accepts: OrderedDict[str, Bucket] = OrderedDict()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def connections(self) -> int:
        return sum(self.open.values())

    def origin(self, peer: str) -> str | None:
        """The remote address behind a call, from gRPC's `context.peer()` of the gate's own
        connection ("ipv4:127.0.0.1:PORT"); None for a connection that bypassed the gate."""
        conn = self._conn(peer)
        return None if conn is None else conn.address

    def vouch(self, peer: str, identity: bytes) -> None:
        """The caller behind `peer` (as `origin` takes it) proved it holds `identity` and that
        the identity lives: charge its connection's bytes to the identity from now on."""
        conn = self._conn(peer)
        if conn is not None:
            conn.identity = identity

    def vouched(self, peer: str) -> bool:
        conn = self._conn(peer)
        return conn is not None and conn.identity is not None

    def _conn(self, peer: str) -> _Conn | None:
        port = peer.rpartition(":")[2]
        return self._origin.get(int(port)) if port.isdigit() else None

    def _charge(self, conn: _Conn, n: int) -> float:
        now, limits = self.clock(), self.limits
        if conn.identity is None:
            conn.bucket.rate = limits.rate / max(1, self.open[conn.address])
            return conn.bucket.charge(n, now)
        bucket = lru_bucket(self._identities, conn.identity,
                      lambda: Bucket(limits.rate, limits.burst, now))
        return bucket.charge(n, now)

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._accept, host, port, limit=CHUNK)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _refuse(self, why: str) -> None:
        self.refused[why] += 1
        self.on_refuse(why)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        await self.serve(reader, writer, str(peer[0]) if peer else "?")

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    address: str) -> None:
        """A connection from `address`: one we accepted, or one a relay's tunnel brought us
        (its address then names the relay and the caller the relay saw)."""
        limits = self.limits
        accepts = lru_bucket(self._accepts, address,
                       lambda: Bucket(limits.accept_rate, limits.accept_burst, self.clock()))
        why = (PER_ADDRESS if self.open[address] >= limits.per_address
               else TOTAL if self.connections >= limits.total
               else ACCEPT_RATE if not accepts.take(1, self.clock()) else None)
        if why is not None:
            self._refuse(why)
            log.debug("gRPC connection from %s refused (%s)", address, why)
            writer.transport.abort()
            return
        self.open[address] += 1
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            await self._relay(address, reader, writer)
        except (OSError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:  # close(): the connection task is ours, and ends here
            pass
        finally:
            self._tasks.discard(task)
            self.open[address] -= 1
            if self.open[address] <= 0:
                del self.open[address]
            writer.transport.abort()

    async def _relay(self, address: str, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(self.limits.first_bytes):
                first = await reader.read(CHUNK)
        except TimeoutError:
            self._refuse(SILENT)
            return
        if not first:
            return
        if first.startswith(REACH_MAGIC):  # a peer checks that our port takes connections
            self.on_reach(first[len(REACH_MAGIC):len(REACH_MAGIC) + 16])
            return
        up_reader, up_writer = await asyncio.open_connection(*self.target, limit=CHUNK)
        for w in (writer, up_writer):
            w.transport.set_write_buffer_limits(high=CHUNK)
        port = int(up_writer.get_extra_info("sockname")[1])
        conn = self._origin[port] = _Conn(
            address, Bucket(self.limits.rate, self.limits.burst, self.clock()))
        try:
            await self._pace(conn, len(first))
            up_writer.write(first)
            pumps = [asyncio.ensure_future(self._pump(reader, up_writer, conn)),
                     asyncio.ensure_future(self._pump(up_reader, writer))]
            try:
                done, _ = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for p in pumps:
                    p.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
            if any(not p.cancelled() and isinstance(p.exception(), TimeoutError) for p in done):
                self._refuse(STALLED)
        finally:
            self._origin.pop(port, None)
            up_writer.transport.abort()

    async def _pace(self, conn: _Conn, n: int) -> None:
        wait = self._charge(conn, n)
        if wait > 0:
            self._refuse(PACED)
            await self.sleep(wait)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    paced: _Conn | None = None) -> None:
        """Until either side closes; at most CHUNK bytes waiting in each direction. What a
        `paced` connection sends is charged to its bucket, and read no faster."""
        while data := await reader.read(CHUNK):
            if paced is not None:
                await self._pace(paced, len(data))
            writer.write(data)
            async with asyncio.timeout(self.limits.stall):
                await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()

