"""A virtual TCP connection: two StreamEnds, each an asyncio transport for its host's protocol.

Writes are cut into segments that cross the network (net.Network.transmit) in order; a
segment's bytes count in the write buffer until they leave the uplink, which is what pauses a
protocol's writing (flow control, as a socket's send buffer does). Segments, EOF and resets
arrive through an inbox that hands them over in order, however the loop orders equal times.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import deque
from typing import Any, Protocol


class Link(Protocol):
    @property
    def delay(self) -> float: ...


class Net(Protocol):
    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    def transmit(self, src: Any, dst: Any, nbytes: int) -> tuple[float, float]: ...


class Host(Protocol):
    """What a connection needs of its host (net.Host)."""

    @property
    def net(self) -> Net: ...
    @property
    def ip(self) -> str: ...
    @property
    def link(self) -> Link: ...
    @property
    def alive(self) -> bool: ...
    @property
    def up_free(self) -> float: ...
    @property
    def ctx(self) -> contextvars.Context: ...
    @property
    def conns(self) -> set[StreamEnd]: ...
    @property
    def tcp(self) -> dict[int, Listener]: ...
    @property
    def sent(self) -> Any: ...

SEGMENT = 64 * 1024  # bytes per scheduled delivery
HIGH, LOW = 64 * 1024, 16 * 1024  # asyncio's default write buffer limits
EOF, RESET = object(), object()
# The base loop runs a timer up to its clock resolution early: an item due within this is due.
EPSILON = 1e-6


class StreamEnd(asyncio.Transport):
    def __init__(self, host: Host, port: int, listener: Listener | None) -> None:
        super().__init__()
        self.host = host
        self.port = port
        self.listener = listener
        self.peer: StreamEnd | None = None
        self.protocol: Any = None
        self._inbox: deque[tuple[float, Any]] = deque()
        self._unsent = 0  # bytes written that have not left the uplink
        self._last = 0.0  # when the last segment we sent arrives
        self._high, self._low = HIGH, LOW
        self._write_paused = False
        self._read_paused = False
        self._closing = False
        self._lost = False
        host.conns.add(self)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self.host.net.loop

    # --- opening --------------------------------------------------------------------------
    def accepted(self) -> None:
        """The listening side: its protocol from the server's factory."""
        if self.listener is None or self.listener.closed or self._lost:
            self.abort()
            return
        self.made(self.listener.factory())

    def made(self, protocol: Any) -> None:
        self.protocol = protocol
        protocol.connection_made(self)
        if self._inbox:
            self.loop.call_soon(self._deliver, context=self.host.ctx)

    # --- writing --------------------------------------------------------------------------
    def write(self, data: Any) -> None:
        if self._closing or self._lost or self.peer is None or not self.host.alive:
            return
        data = bytes(data)
        net = self.host.net
        self.host.sent["stream_bytes"] += len(data)
        for i in range(0, len(data), SEGMENT):
            seg = data[i:i + SEGMENT]
            left, at = net.transmit(self.host, self.peer.host, len(seg))
            self._unsent += len(seg)
            self.loop.call_at(left, self._left, len(seg), context=self.host.ctx)
            self._send(at, seg)
        if self._unsent > self._high and not self._write_paused:
            self._write_paused = True
            self.protocol.pause_writing()

    def writelines(self, list_of_data: Any) -> None:
        self.write(b"".join(bytes(d) for d in list_of_data))

    def _send(self, at: float, item: Any) -> None:
        peer = self.peer
        assert peer is not None
        self._last = at = max(at, self._last)
        peer._inbox.append((at, item))
        self.loop.call_at(at, peer._deliver, context=peer.host.ctx)

    def _reset_peer(self) -> None:
        """Tell the other end its connection is reset (once): we aborted, or bytes reached us
        after we closed, which a TCP kernel answers with a reset too, so the sender learns
        that what it wrote was never read."""
        peer = self.peer
        if peer is not None and not peer._lost and all(i is not RESET for _, i in peer._inbox):
            self._send(self.loop.time() + self.host.link.delay + peer.host.link.delay, RESET)

    def _left(self, n: int) -> None:
        self._unsent -= n
        if self._write_paused and self._unsent <= self._low and not self._lost:
            self._write_paused = False
            self.protocol.resume_writing()

    def get_write_buffer_size(self) -> int:
        return self._unsent

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._low, self._high

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._high = HIGH if high is None else high
        self._low = self._high // 4 if low is None else low

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        if not (self._closing or self._lost) and self.peer is not None:
            self._send(self.loop.time(), EOF)

    # --- reading --------------------------------------------------------------------------
    def _deliver(self) -> None:
        now = self.loop.time() + EPSILON
        if self._lost:
            if any(t <= now and item is not EOF and item is not RESET
                   for t, item in self._inbox):
                self._reset_peer()
            self._inbox.clear()
            return
        while (self._inbox and self._inbox[0][0] <= now and self.protocol is not None
               and not self._read_paused and not self._lost):
            _, item = self._inbox.popleft()
            if item is RESET:
                self._lose(ConnectionResetError(104, "connection reset by peer"))
            elif item is EOF:
                if not self.protocol.eof_received():
                    self.close()
            elif isinstance(self.protocol, asyncio.BufferedProtocol):
                view = memoryview(item)
                while view:
                    buf = memoryview(self.protocol.get_buffer(len(view)))
                    n = min(len(buf), len(view))
                    if n == 0:
                        raise RuntimeError("get_buffer() returned an empty buffer")
                    buf[:n] = view[:n]
                    self.protocol.buffer_updated(n)
                    view = view[n:]
            else:
                self.protocol.data_received(item)

    def pause_reading(self) -> None:
        self._read_paused = True

    def resume_reading(self) -> None:
        if self._read_paused:
            self._read_paused = False
            self.loop.call_soon(self._deliver, context=self.host.ctx)

    def is_reading(self) -> bool:
        return not self._read_paused

    # --- closing --------------------------------------------------------------------------
    def close(self) -> None:
        if self._closing or self._lost:
            return
        self._closing = True
        if self.peer is not None and self.host.alive:
            self._send(self.loop.time(), EOF)
        self.loop.call_at(max(self.loop.time(), self.host.up_free), self._lose, None,
                          context=self.host.ctx)

    def abort(self) -> None:
        if self._lost:
            return
        self._closing = True
        self._reset_peer()
        self.loop.call_soon(self._lose, None, context=self.host.ctx)

    def _lose(self, exc: BaseException | None) -> None:
        if self._lost:
            return
        self._lost = self._closing = True
        self.host.conns.discard(self)
        if any(item is not EOF and item is not RESET for _, item in self._inbox):
            self._reset_peer()  # unread bytes at close: TCP resets too
        self._inbox.clear()
        if self.protocol is not None:
            self.protocol.connection_lost(exc)

    def is_closing(self) -> bool:
        return self._closing or self._lost

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "sockname":
            return (self.host.ip, self.port)
        if name == "peername" and self.peer is not None:
            return (self.peer.host.ip, self.peer.port)
        return default

    def set_protocol(self, protocol: Any) -> None:
        self.protocol = protocol

    def get_protocol(self) -> Any:
        return self.protocol


class _Sock:
    def __init__(self, ip: str, port: int) -> None:
        self._name = (ip, port)

    def getsockname(self) -> tuple[str, int]:
        return self._name


class Listener:
    """What `create_server` returns: enough of asyncio.Server for the daemon."""

    def __init__(self, host: Host, port: int, factory: Any) -> None:
        self.host = host
        self.port = port
        self.factory = factory
        self.closed = False
        self.sockets = [_Sock(host.ip, port)]

    def close(self) -> None:
        self.closed = True
        if self.host.tcp.get(self.port) is self:
            del self.host.tcp[self.port]

    async def wait_closed(self) -> None:
        return None

    def is_serving(self) -> bool:
        return not self.closed

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self.host.net.loop

    async def start_serving(self) -> None:
        return None
