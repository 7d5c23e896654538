"""The virtual network: hosts with an uplink, a downlink and a one-way delay to the core.

A packet from A to B leaves A's uplink in order (FIFO behind everything A sent before it, at
A's rate), crosses A's and B's delays, then B's downlink at B's rate: queues form where links
are slow, as on the internet, and a host's datagrams wait behind its own bulk data. Datagrams
are lost with either end's loss rate; streams are reliable (TCP hides loss behind its own
retransmissions, which the delay does not model). B's downlink is charged when A sends.

Each host owns a contextvars.Context holding its clock (timebase.CLOCK) and itself (HOST):
everything the network delivers to a host runs in it, and every task its code creates
inherits it.
"""

from __future__ import annotations

import asyncio
import contextvars
import random
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any

from moshpitd import timebase
from moshpitd.virtual.loop import HOST, VirtualLoop
from moshpitd.virtual.streams import Listener, StreamEnd

EPOCH = 1.8e9  # wall time at virtual time 0: a plausible date (records carry wall-clock ns)
SYN_TIMEOUT = 20.0  # s a connection to an address nobody answers at waits before it fails
FIRST_PORT = 40000


@dataclass(frozen=True)
class Link:
    delay: float  # s, one way, between the host and the core
    up: float  # bytes/s
    down: float  # bytes/s
    loss: float = 0.0  # of datagrams


class NodeClock:
    """A host's clock: the loop's virtual time, and its wall clock `offset` s off the others'."""

    def __init__(self, loop: VirtualLoop, offset: float) -> None:
        self.loop = loop
        self.offset = offset

    def monotonic(self) -> float:
        return self.loop.time()

    def wall(self) -> float:
        return EPOCH + self.loop.time() + self.offset


class Host:
    def __init__(self, net: Network, ip: str, link: Link, clock_offset: float) -> None:
        self.net = net
        self.ip = ip
        self.link = link
        self.alive = True
        self.up_free = self.down_free = 0.0
        self.udp: dict[int, DatagramEnd] = {}
        self.tcp: dict[int, Listener] = {}
        self.control: dict[int, Any] = {}  # port -> its control server (control.py)
        self.conns: set[StreamEnd] = set()
        self.tasks: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()
        self.sent: Counter[str] = Counter()  # datagrams, datagram_bytes, stream_bytes, ...
        self._port = FIRST_PORT
        self.ctx = contextvars.Context()
        self.ctx.run(self._enter, NodeClock(net.loop, clock_offset))

    def _enter(self, clock: NodeClock) -> None:
        timebase.CLOCK.set(clock)
        HOST.set(self)

    def port(self, wanted: int = 0) -> int:
        if wanted:
            return wanted
        while self._port in self.udp or self._port in self.tcp or self._port in self.control:
            self._port += 1
        self._port += 1
        return self._port - 1

    def start(self, coro: Any) -> asyncio.Task[Any]:
        """Run `coro` as this host's task (in a copy of its context)."""
        return self.net.loop.create_task(coro, context=self.ctx.copy())

    def kill(self) -> None:
        """The host's process dies: its peers' connections are reset, its tasks cancelled,
        its ports close. Datagrams to it are lost from now on."""
        self.alive = False
        for end in list(self.conns):
            end.abort()
        for d in list(self.udp.values()):
            d.close()
        for lst in list(self.tcp.values()):
            lst.close()
        self.control.clear()
        for task in list(self.tasks):
            task.cancel()


class Network:
    def __init__(self, loop: VirtualLoop, seed: int = 0) -> None:
        self.loop = loop
        loop.net = self
        self.rng = random.Random(seed)
        self.hosts: dict[str, Host] = {}
        self._count = 0
        loop.set_exception_handler(self._on_error)

    def _on_error(self, loop: Any, context: dict[str, Any]) -> None:
        """What a dead host's leftovers raise (a timer of its DHT library finding the call it
        guards cancelled with the host's tasks) is nobody's error."""
        handle = context.get("handle")
        ctx = getattr(handle, "_context", None)
        host = ctx.get(HOST) if ctx is not None else None
        if host is not None and not host.alive:
            return
        loop.default_exception_handler(context)

    def add_host(self, link: Link, clock_offset: float = 0.0) -> Host:
        self._count += 1
        i = self._count
        ip = f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}"
        host = Host(self, ip, link, clock_offset)
        self.hosts[ip] = host
        return host

    @staticmethod
    def here() -> Host:
        host = HOST.get()
        if host is None:
            raise RuntimeError("virtual sockets are opened from a host's context (Host.start)")
        return host

    def transmit(self, src: Host, dst: Host, nbytes: int) -> tuple[float, float]:
        """When `nbytes` sent now leave src's uplink, and when they have crossed dst's
        downlink."""
        now = self.loop.time()
        if src is dst:
            return now, now
        left = max(now, src.up_free) + nbytes / src.link.up
        src.up_free = left
        arrives = left + src.link.delay + dst.link.delay
        done = max(arrives, dst.down_free) + nbytes / dst.link.down
        dst.down_free = done
        return left, done

    def rtt(self, a: Host, b: Host) -> float:
        return 2 * (a.link.delay + b.link.delay)

    # --- datagrams ------------------------------------------------------------------------
    def datagram_endpoint(self, factory: Any, port: int) -> tuple[DatagramEnd, Any]:
        host = self.here()
        port = host.port(port)
        if port in host.udp:
            raise OSError(98, f"address {host.ip}:{port} already in use")
        protocol = factory()
        end = DatagramEnd(host, port, protocol)
        host.udp[port] = end
        protocol.connection_made(end)
        return end, protocol

    def send_datagram(self, end: DatagramEnd, data: bytes, addr: tuple[str, int]) -> None:
        src = end.host
        if not src.alive:
            return
        src.sent["datagrams"] += 1
        src.sent["datagram_bytes"] += len(data) + 28  # IP and UDP headers
        dst = self.hosts.get(addr[0])
        if dst is None:
            return
        _, at = self.transmit(src, dst, len(data) + 28)
        loss = 1 - (1 - src.link.loss) * (1 - dst.link.loss)
        if loss and self.rng.random() < loss:
            return
        self.loop.call_at(at, _deliver_datagram, dst, int(addr[1]), bytes(data),
                          (src.ip, end.port), context=dst.ctx)

    # --- streams --------------------------------------------------------------------------
    def listen(self, factory: Any, port: int) -> Listener:
        host = self.here()
        port = host.port(port)
        if port in host.tcp:
            raise OSError(98, f"address {host.ip}:{port} already in use")
        lst = Listener(host, port, factory)
        host.tcp[port] = lst
        return lst

    async def connect(self, factory: Any, ip: str, port: int) -> tuple[StreamEnd, Any]:
        src = self.here()
        dst = self.hosts.get(ip)
        if dst is None or not dst.alive:
            await asyncio.sleep(SYN_TIMEOUT)
            raise TimeoutError(f"connect to {ip}:{port}: no answer")
        one_way = src.link.delay + dst.link.delay
        await asyncio.sleep(one_way)
        lst = dst.tcp.get(port)
        if lst is None or not dst.alive:
            await asyncio.sleep(one_way)
            raise ConnectionRefusedError(111, f"connect to {ip}:{port}: refused")
        mine = StreamEnd(src, src.port(), None)
        theirs = StreamEnd(dst, port, lst)
        mine.peer, theirs.peer = theirs, mine
        self.loop.call_soon(theirs.accepted, context=dst.ctx)
        try:
            await asyncio.sleep(one_way)
        except asyncio.CancelledError:
            theirs.abort()
            raise
        protocol = factory()
        mine.made(protocol)
        return mine, protocol


def _deliver_datagram(dst: Host, port: int, data: bytes, addr: tuple[str, int]) -> None:
    end = dst.udp.get(port)
    if end is not None and dst.alive:
        end.protocol.datagram_received(data, addr)


class DatagramEnd(asyncio.DatagramTransport):
    def __init__(self, host: Host, port: int, protocol: Any) -> None:
        super().__init__()
        self.host = host
        self.port = port
        self.protocol = protocol
        self._closed = False

    def sendto(self, data: Any, addr: Any = None) -> None:
        if not self._closed:
            self.host.net.send_datagram(self, bytes(data), addr)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.host.udp.get(self.port) is self:
            del self.host.udp[self.port]
        self.host.net.loop.call_soon(self.protocol.connection_lost, None, context=self.host.ctx)

    def abort(self) -> None:
        self.close()

    def is_closing(self) -> bool:
        return self._closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "sockname":
            return (self.host.ip, self.port)
        return default
