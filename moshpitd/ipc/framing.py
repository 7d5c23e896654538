"""Length-prefixed msgpack frames over a unix socket that may also carry file descriptors.

asyncio's streams cannot receive SCM_RIGHTS, so the connection reads with recvmsg itself and
queues any descriptors that arrive; the frame that announces a buffer takes the next one.
"""

from __future__ import annotations

import array
import asyncio
import os
import socket
from collections import deque
from typing import Any

import msgpack

from moshpitd.ipc.schema import LENGTH_PREFIX as _LEN
from moshpitd.ipc.schema import MAX_FRAME

MAX_FDS = 4


class ProtocolError(Exception):
    """The peer broke the framing; the connection cannot continue."""


class ConnectionClosed(Exception):
    """The peer closed the connection."""


def pack_frame(obj: dict[str, Any]) -> bytes:
    payload = msgpack.packb(obj, use_bin_type=True)
    return len(payload).to_bytes(_LEN, "big") + payload


class FramedSocket:
    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.buf = bytearray()
        self.fds: deque[int] = deque()
        self._write_lock = asyncio.Lock()

    async def _readable(self) -> None:
        fut: asyncio.Future[None] = self.loop.create_future()

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        self.loop.add_reader(self.sock.fileno(), ready)
        try:
            await fut
        finally:
            self.loop.remove_reader(self.sock.fileno())

    async def _recv(self) -> None:
        while True:
            try:
                data, anc, flags, _ = self.sock.recvmsg(
                    1 << 16, socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
                )
                break
            except (BlockingIOError, InterruptedError):
                await self._readable()
        received: list[int] = []
        for level, kind, cdata in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(cdata[: len(cdata) - len(cdata) % fds.itemsize])
                received.extend(fds)
        self.fds.extend(received)
        if flags & socket.MSG_CTRUNC or len(self.fds) > MAX_FDS:
            self.close_fds()
            raise ProtocolError(f"too many file descriptors (at most {MAX_FDS} in flight)")
        if not data:
            raise ConnectionClosed()
        self.buf += data

    async def read_frame(self) -> dict[str, Any]:
        while len(self.buf) < _LEN:
            await self._recv()
        size = int.from_bytes(self.buf[:_LEN], "big")
        if size > MAX_FRAME:
            raise ProtocolError(f"frame of {size} bytes exceeds the {MAX_FRAME}-byte limit")
        while len(self.buf) < _LEN + size:
            await self._recv()
        payload = bytes(self.buf[_LEN:_LEN + size])
        del self.buf[:_LEN + size]
        try:
            obj = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types
            raise ProtocolError(f"undecodable msgpack frame: {exc}") from exc
        if not isinstance(obj, dict):
            raise ProtocolError(f"a frame must be a map, got {type(obj).__name__}")
        return obj

    def take_fd(self) -> int | None:
        return self.fds.popleft() if self.fds else None

    async def write_frame(self, obj: dict[str, Any]) -> None:
        data = pack_frame(obj)
        async with self._write_lock:
            await self.loop.sock_sendall(self.sock, data)

    def close_fds(self) -> None:
        while self.fds:
            os.close(self.fds.popleft())

    def close(self) -> None:
        self.close_fds()
        self.sock.close()
