"""The trainer's end of the IPC socket: frames out and in, the hello handshake, and error
replies raised as the client's exceptions (client/errors.py). The contract itself, every op's
fields and codes, is moshpitd/ipc/schema.py."""

from __future__ import annotations

import array
import contextlib
import socket
import time
from collections.abc import Iterator
from typing import Any, TypeVar

import msgpack

from moshpit.errors import (
    DaemonUnavailable,
    MoshpitError,
    ProtocolError,
    VersionMismatch,
    from_reply,
)
from moshpitd.ipc import schema as wire
from moshpitd.ipc.schema import IPC_PROTOCOL, LENGTH_PREFIX, MAX_FRAME

R = TypeVar("R", bound=wire.Message)
# s to look for a frame the daemon wrote before it closed the connection: if there is one, it
# already lies in our socket's receive buffer
LAST_WORDS_WAIT = 0.05
LAST_WORDS_FRAMES = 8  # unread replies looked through for them
# s: the shortest socket timeout set while a deadline is not yet past (0 would make the socket
# non-blocking, not time out)
MIN_SOCKET_TIMEOUT = 0.001


def decode_reply(op: str, frame: dict[str, Any], reply: type[R]) -> R:
    """An ok reply to `op` by field name; one that does not fit is a ProtocolError."""
    try:
        decoded = wire.decode_reply(op, frame)
    except wire.IPCError as exc:
        raise ProtocolError(f"the daemon's reply does not fit this library: {exc}") from None
    assert isinstance(decoded, reply)
    return decoded


class DaemonConnection:
    """One unix socket to a daemon; not thread-safe (moshpit.Client serialises)."""

    def __init__(self, socket_path: str, connect_timeout: float) -> None:
        self.socket_path = socket_path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(connect_timeout)
        try:
            self._sock.connect(socket_path)
        except OSError as exc:
            self._sock.close()
            raise DaemonUnavailable(f"cannot connect to moshpitd at {socket_path}: {exc}") from exc
        self._next_id = 0
        self._awaited: set[int] = set()  # ids whose reply someone will read

    def close(self) -> None:
        self._sock.close()

    def hello(self, timeout: float) -> wire.HelloReply:
        """The handshake: both sides must speak IPC_PROTOCOL."""
        frame = self.request(wire.HelloRequest(protocol=IPC_PROTOCOL), timeout)
        theirs = frame.get("protocol")
        if theirs != IPC_PROTOCOL:
            spoken = "the unversioned IPC protocol 1" if theirs is None else \
                f"IPC protocol {theirs!r}"
            raise VersionMismatch(
                f"version_mismatch: moshpitd at {self.socket_path} (version "
                f"{frame.get('version', '?')}) speaks {spoken}, this moshpit library speaks "
                f"{IPC_PROTOCOL}: install matching versions")
        return decode_reply(wire.HelloRequest.OP, frame, wire.HelloReply)

    def request(self, req: wire.Message, timeout: float,
                fd: int | None = None) -> dict[str, Any]:
        return self.reply(self.send(req, timeout, fd), timeout)

    def send(self, req: wire.Message, timeout: float, fd: int | None = None,
             awaited: bool = True) -> int:
        """Sends one request; its id, which `reply` waits for (unless not `awaited`: a
        `ready`'s reply comes only if it fails, and nobody reads it)."""
        self._next_id += 1
        rid = self._next_id
        if awaited:
            self._awaited.add(rid)
        payload = msgpack.packb(wire.request_frame(req, rid), use_bin_type=True)
        frame = len(payload).to_bytes(LENGTH_PREFIX, "big") + payload
        with self._failures(timeout):
            self._sock.settimeout(timeout)
            if fd is None:
                self._sock.sendall(frame)
            else:
                sent = self._sock.sendmsg(
                    [frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
                )
                if sent < len(frame):
                    self._sock.sendall(frame[sent:])
        return rid

    def reply(self, rid: int, timeout: float) -> dict[str, Any]:
        """The reply to request `rid`; replies to earlier requests nobody waited for (a
        `ready`'s, say) are skipped."""
        with self._failures(timeout):
            deadline = time.monotonic() + timeout
            while True:
                reply = self._read_frame(deadline)
                if reply.get("id") in (rid, None):
                    break
        self._awaited.discard(rid)
        if not reply.get("ok"):
            raise from_reply(reply)
        return reply

    @contextlib.contextmanager
    def _failures(self, timeout: float) -> Iterator[None]:
        """The socket's failures as the errors a trainer can act on."""
        try:
            yield
        except TimeoutError as exc:
            raise DaemonUnavailable(f"no reply from moshpitd within {timeout:.1f} s") from exc
        except OSError as exc:
            last = self._last_words()
            if last is not None:  # it said why it went (a drain): raise that, not EPIPE
                raise from_reply(last) from exc
            raise DaemonUnavailable(f"lost the connection to moshpitd: {exc}") from exc

    def _last_words(self) -> dict[str, Any] | None:
        """The first error the daemon sent before closing, if one waits unread: its goodbye
        (id nil), or the refusal of a request whose reply we await (the one whose follow-up,
        `ready`, found the socket closed lies before the goodbye). A stale reply to a `ready`
        nobody reads is skipped."""
        deadline = time.monotonic() + LAST_WORDS_WAIT
        for _ in range(LAST_WORDS_FRAMES):
            try:
                frame = self._read_frame(deadline)
            except (OSError, MoshpitError, ValueError):
                return None
            rid = frame.get("id")
            if not frame.get("ok") and (rid is None or rid in self._awaited):
                return frame
        return None

    def _read_frame(self, deadline: float) -> dict[str, Any]:
        head = self._recv_exact(LENGTH_PREFIX, deadline)
        size = int.from_bytes(head, "big")
        if size > MAX_FRAME:
            raise ProtocolError(f"reply frame of {size} bytes is too large")
        try:
            obj = msgpack.unpackb(self._recv_exact(size, deadline), raw=False)
        except ValueError as exc:  # msgpack's errors derive from it
            raise ProtocolError(f"undecodable reply frame: {exc}") from exc
        if not isinstance(obj, dict):
            raise ProtocolError("reply is not a map")
        return obj

    def _recv_exact(self, n: int, deadline: float) -> bytes:
        chunks, got = [], 0
        while got < n:
            self._sock.settimeout(max(deadline - time.monotonic(), MIN_SOCKET_TIMEOUT))
            chunk = self._sock.recv(n - got)
            if not chunk:
                raise DaemonUnavailable("moshpitd closed the connection")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)
