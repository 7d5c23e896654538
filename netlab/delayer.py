"""Namespace-side: the delaying transparent proxy and the round-trip probe. Runs as a script,
`python netlab/delayer.py delay|ping ...`, inside a host's namespace (see the package
docstring); it imports nothing outside the standard library but uvloop, if installed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import signal
import socket
import statistics
import struct
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

SOL_IP = 0
IP_TRANSPARENT = 19
IP_RECVORIGDSTADDR = 20
IP_ORIGDSTADDR = 20

PROXY_PORT = 7800  # where tproxy hands intercepted traffic (TCP and UDP)
ECHO_PORT = 7799  # a TCP and UDP echo service in each host, to measure round trips

HIGH_WATER = 4 << 20  # bytes queued per direction before reading pauses
LOW_WATER = 1 << 20


class _Direction:
    """Bytes read from `src`, written to `dst` `delay` seconds after they were read, in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop, delay: float) -> None:
        self.loop = loop
        self.delay = delay
        self.src: asyncio.Transport | None = None
        self.dst: asyncio.Transport | None = None
        self.queue: collections.deque[tuple[float, bytes | None]] = collections.deque()
        self.queued = 0
        self.timer: asyncio.TimerHandle | None = None
        self.src_paused = False
        self.done = False  # EOF delivered
        self.on_done: list[Callable[[], None]] = []

    def push(self, data: bytes | None) -> None:
        """Queue bytes, or None for end of stream."""
        self.queue.append((self.loop.time() + self.delay, data))
        self.queued += len(data or b"")
        self._schedule()
        self.flow()

    def _schedule(self) -> None:
        if self.timer is None and self.queue and self.dst is not None:
            self.timer = self.loop.call_at(self.queue[0][0], self._flush)

    def _flush(self) -> None:
        self.timer = None
        now = self.loop.time()
        while self.queue and self.queue[0][0] <= now and self.dst is not None:
            _, data = self.queue.popleft()
            self.queued -= len(data or b"")
            if data is None:
                self.done = True
                if self.dst.is_closing():
                    pass
                elif self.dst.can_write_eof():
                    self.dst.write_eof()
                else:
                    self.dst.close()
                for cb in self.on_done:
                    cb()
            elif not self.dst.is_closing():
                self.dst.write(data)
        self._schedule()
        self.flow()

    def flow(self) -> None:
        if self.src is None or self.src.is_closing():
            return
        pending = self.queued + (self.dst.get_write_buffer_size() if self.dst else 0)
        if pending > HIGH_WATER and not self.src_paused:
            self.src_paused = True
            self.src.pause_reading()
        elif pending < LOW_WATER and self.src_paused:
            self.src_paused = False
            self.src.resume_reading()


class _Side(asyncio.Protocol):
    """One TCP connection of a proxied pair; `incoming` carries what it receives."""

    def __init__(self, incoming: _Direction, outgoing: _Direction) -> None:
        self.incoming = incoming
        self.outgoing = outgoing

    def data_received(self, data: bytes) -> None:
        self.incoming.push(data)

    def eof_received(self) -> bool:
        self.incoming.push(None)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.incoming.done:
            self.incoming.push(None)

    def pause_writing(self) -> None:
        pass

    def resume_writing(self) -> None:
        self.outgoing.flow()


class _Pair:
    def __init__(self, loop: asyncio.AbstractEventLoop, delay: float) -> None:
        self.forward = _Direction(loop, delay)  # client -> server
        self.backward = _Direction(loop, delay)  # server -> client
        self.client = _Side(self.forward, self.backward)
        self.server = _Side(self.backward, self.forward)
        self.forward.on_done.append(self._maybe_close)
        self.backward.on_done.append(self._maybe_close)

    def _maybe_close(self) -> None:
        if self.forward.done and self.backward.done:
            for d in (self.forward, self.backward):
                if d.dst is not None:
                    d.dst.close()


class _Intercepted(asyncio.Protocol):
    """An intercepted connection; its socket's local address is the original target."""

    def __init__(self, loop: asyncio.AbstractEventLoop, delay: float) -> None:
        self.loop = loop
        self.delay = delay
        self.pair = _Pair(loop, delay)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        transport.pause_reading()
        self.pair.forward.src = transport
        self.pair.backward.dst = transport
        target = transport.get_extra_info("sockname")
        self.loop.create_task(self._connect(transport, target[0], target[1]))

    async def _connect(self, client: asyncio.Transport, host: str, port: int) -> None:
        try:
            server, _ = await self.loop.create_connection(lambda: self.pair.server, host, port)
        except OSError:
            client.abort()
            return
        self.pair.forward.dst = server
        self.pair.backward.src = server
        self.pair.forward._schedule()
        self.pair.backward._schedule()
        if not client.is_closing():
            client.resume_reading()

    def data_received(self, data: bytes) -> None:
        self.pair.client.data_received(data)

    def eof_received(self) -> bool:
        return self.pair.client.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.pair.client.connection_lost(exc)

    def resume_writing(self) -> None:
        self.pair.client.resume_writing()


class _UdpDelayer:
    """Re-sends intercepted datagrams `delay` seconds later, from their original source."""

    def __init__(self, loop: asyncio.AbstractEventLoop, delay: float, port: int) -> None:
        self.loop = loop
        self.delay = delay
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(SOL_IP, IP_TRANSPARENT, 1)
        self.sock.setsockopt(SOL_IP, IP_RECVORIGDSTADDR, 1)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.bind(("0.0.0.0", port))
        self.sock.setblocking(False)
        self.senders: dict[tuple[str, int], socket.socket] = {}
        loop.add_reader(self.sock.fileno(), self._readable)

    def _readable(self) -> None:
        while True:
            try:
                data, ancdata, _, src = self.sock.recvmsg(65535, socket.CMSG_SPACE(16))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                continue
            dst = None
            for level, kind, raw in ancdata:
                if level == SOL_IP and kind == IP_ORIGDSTADDR:
                    port, addr = struct.unpack_from("!2xH4s", raw)
                    dst = (socket.inet_ntoa(addr), port)
            if dst is not None:
                self.loop.call_at(self.loop.time() + self.delay, self._send, data, src, dst)

    def _send(self, data: bytes, src: tuple[str, int], dst: tuple[str, int]) -> None:
        sock = self.senders.get(src)
        if sock is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.setsockopt(SOL_IP, IP_TRANSPARENT, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            try:
                sock.bind(src)
            except OSError:
                sock.close()
                return
            sock.setblocking(False)
            self.senders[src] = sock
        with contextlib.suppress(OSError):
            sock.sendto(data, dst)


class _Echo(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)


class _UdpEcho(asyncio.DatagramProtocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.transport.sendto(data, addr)


async def _serve_delayer(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.setsockopt(SOL_IP, IP_TRANSPARENT, 1)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind(("0.0.0.0", args.port))
    tcp.listen(512)
    server = await loop.create_server(lambda: _Intercepted(loop, args.delay), sock=tcp)
    _UdpDelayer(loop, args.delay, args.port)
    echo_host, echo_port = args.echo.rsplit(":", 1)
    await loop.create_server(_Echo, echo_host, int(echo_port))
    await loop.create_datagram_endpoint(_UdpEcho, local_addr=(echo_host, int(echo_port)))
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    Path(args.ready).write_text("ready\n")
    await stop.wait()
    server.close()


def _ping(target: str, count: int) -> dict[str, float]:
    host, port_s = target.rsplit(":", 1)
    port = int(port_s)
    tcp_times: list[float] = []
    start = time.monotonic()
    conn = socket.create_connection((host, port), timeout=5)
    connect_ms = (time.monotonic() - start) * 1000
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for i in range(count + 1):
        start = time.monotonic()
        conn.sendall(bytes([i % 256]))
        conn.recv(1)
        if i:  # the first one also pays for the proxy's connection to the target
            tcp_times.append((time.monotonic() - start) * 1000)
    conn.close()
    udp_times: list[float] = []
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.settimeout(1.0)
    for i in range(count * 2):
        if len(udp_times) >= count:
            break
        start = time.monotonic()
        udp.sendto(i.to_bytes(4, "big"), (host, port))
        try:
            while udp.recv(16) != i.to_bytes(4, "big"):
                pass
        except TimeoutError:
            continue  # lost
        udp_times.append((time.monotonic() - start) * 1000)
    return {"tcp_connect_ms": connect_ms,
            "tcp_rtt_ms": statistics.median(tcp_times),
            "udp_rtt_ms": statistics.median(udp_times) if udp_times else float("nan")}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    delay = sub.add_parser("delay", help="run the delaying transparent proxy in this namespace")
    delay.add_argument("--delay", type=float, required=True, help="seconds per direction")
    delay.add_argument("--port", type=int, default=PROXY_PORT)
    delay.add_argument("--echo", required=True, help="HOST:PORT for the TCP and UDP echo")
    delay.add_argument("--ready", required=True, help="file written once listening")
    ping = sub.add_parser("ping", help="time round trips to a host's echo service")
    ping.add_argument("target")
    ping.add_argument("--count", type=int, default=10)
    args = parser.parse_args(argv)
    if args.cmd == "delay":
        try:
            import uvloop
            uvloop.install()
        except ImportError:
            pass
        asyncio.run(_serve_delayer(args))
        return 0
    print(json.dumps(_ping(args.target, args.count)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
