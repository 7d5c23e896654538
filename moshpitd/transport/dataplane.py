"""The tensor data plane: plain TCP between daemons, parts written from and read into place.

gRPC carries the control messages, but its Python API wants each message as one `bytes`, which
costs a copy per part on each side and a per-message overhead that caps a stream well below
what the wire gives (see the closing notes of the speed work). Here a part leaves the trainer's
shared buffer as a memoryview handed to the socket, and arrives with recv_into straight into
its destination (a staging buffer, where it is checked before it counts). A part that lies in
several pieces of memory goes out as one frame of several payloads.

Frame: 24-byte header (kind u8, flags u8, reserved u16, part u32, length u64, aux u64;
little-endian), then `length` payload bytes. `aux` is the sender index in HELLO, the
contributors bitmask in RESULT, and in ABORT a reason code (BAD_VALUES: the frame's part was
refused as data, e.g. NaN/Inf, so its sender can check its own values and tell its trainer;
LEFT: the member leaves the round, so neither its parts nor its results will come; BUSY: the
owner does not know the HELLO's group yet and has no room for another such stream, so the
sender tries again).
A stream opens with the sender's signed HELLO; the owner answers with its signed READY once
the stream is attached to its round (transport/handshake.py), and the sender streams its parts
once every owner is READY (allreduce/ownerlink.py, ReadyGate). From then on, when the daemons
encrypt, every frame in both directions is sealed (transport/framecrypt.py): `length` counts
the payload's ciphertext and its tag, and the header is authenticated with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

from moshpitd import timebase
from moshpitd.transport.framecrypt import TAG, FrameCipher, TamperedFrame
from moshpitd.transport.stats import Stats
from moshpitd.transport.tcp import set_congestion, set_keepalive

if TYPE_CHECKING:
    from moshpitd.transport.session import Session

log = logging.getLogger(__name__)

HEADER = struct.Struct("<BBHIQQ")
HELLO, PART, RESULT, ABORT, READY, CHECK = 1, 2, 3, 4, 5, 6
RELAY = 7  # the first and only frame of a connection that is no stream (moshpitd/nat/wire.py)
KINDS = {HELLO, PART, RESULT, ABORT, READY, CHECK, RELAY}
MAX_CONTROL_PAYLOAD = 4096
MAX_CHECK_PAYLOAD = 64 << 10  # a checked round's lists: 34 bytes a member, 1024 members at most
BAD_VALUES = 1  # ABORT's aux: the part named in the frame was refused as data
LEFT = 2  # ABORT's aux: the member that sent it left the round
BUSY = 3  # ABORT's aux: no room here for a stream of an unknown group now: open it again
FRAME_SLACK = HEADER.size + TAG  # room a sink's buffer gives past a data frame's payload

__all__ = ["ABORT", "BAD_VALUES", "BUSY", "CHECK", "FRAME_SLACK", "HEADER", "HELLO", "LEFT", "PART",
           "READY", "RELAY", "RESULT", "Channel", "DataPlaneError", "FrameSink", "TamperedFrame",
           "connect", "flush_aborts", "serve", "split_endpoint"]


class DataPlaneError(Exception):
    """A peer broke the data-plane protocol."""


class FrameSink(Protocol):
    def buffer_for(self, kind: int, part: int, length: int, aux: int) -> memoryview | None:
        """Where the payload goes (`length` bytes, and up to FRAME_SLACK more: a sealed frame's
        tag, and the next header, which may land there), or None for a fresh buffer. Give room
        only where the next frame goes to this same sink: a header that came along is parsed as
        soon as on_frame returns, even if on_frame paused reading (as the HELLO handler does
        before it hands the stream to a round). Raise DataPlaneError to refuse the frame."""

    def on_frame(self, kind: int, part: int, payload: memoryview, aux: int) -> None:
        """A whole frame arrived."""

    def on_close(self, exc: BaseException | None) -> None:
        """The connection is gone."""


class Channel(asyncio.BufferedProtocol):
    """One TCP connection of the data plane, in either direction."""

    def __init__(self, sink: FrameSink | None = None, max_payload: int = 64 << 20,
                 congestion: str = "") -> None:
        self.sink = sink
        self.max_payload = max_payload
        self.congestion = congestion  # TCP_CONGESTION for this connection; "": the host's
        self.transport: asyncio.Transport | None = None
        self._hdr = bytearray(HEADER.size)
        self._target = memoryview(self._hdr)
        self._filled = 0
        self._want = HEADER.size  # bytes of _target that complete what we read
        self._frame: tuple[int, int, int, int, int] | None = None  # kind, part, plain, aux,
        # and wire length
        self.cipher: FrameCipher | None = None  # set once the handshake is done: frames sealed
        self.session: Session | None = None  # set by the first stream's handshake (session.py)
        self._aad = b""  # a sealed frame's header, which its tag authenticates
        self.failure: BaseException | None = None  # why we aborted: the sink hears it on close
        self._can_write = asyncio.Event()
        self._can_write.set()
        loop = asyncio.get_running_loop()
        self.closed: asyncio.Future[BaseException | None] = loop.create_future()
        self.gone: asyncio.Future[None] = loop.create_future()  # connection_lost ran
        self.aborted = False  # we sent ABORT: the transport closes once its bytes are out
        self.bytes_in = 0
        self.bytes_out = 0
        self._written = 0  # bytes handed to the transport since the connection opened
        # monotonic times of the first and last bytes each way (allreduce/rates.py)
        self.first_in = self.last_in = self.first_out = self.last_out = 0.0

    def is_open(self) -> bool:
        return (self.transport is not None and not self.transport.is_closing()
                and not self.closed.done())

    def flushed(self, upto: int | None = None) -> bool:
        """Whether the transport has handed the kernel every byte queued on this connection
        up to offset `upto` (`written` then), default all: a stream that ended at some offset
        knows its own bytes are out, whatever a later stream queued after them."""
        pending = 0
        if self.transport is not None and not self.transport.is_closing():
            pending = self.transport.get_write_buffer_size()
        return self._written - pending >= (self._written if upto is None else upto)

    @property
    def written(self) -> int:
        """Bytes queued on this connection since it opened, every stream's."""
        return self._written

    def stats(self) -> Stats:
        """This stream's bytes and times (allreduce/rates.py), frozen: a session carries the
        next stream's after `reset_stats`."""
        return Stats(self.bytes_in, self.bytes_out, self.first_in, self.last_in,
                     self.first_out, self.last_out)

    def reset_stats(self) -> None:
        """A new stream starts on this connection (a session's): its own bytes and times."""
        self.bytes_in = self.bytes_out = 0
        self.first_in = self.last_in = self.first_out = self.last_out = 0.0

    # --- asyncio protocol ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # No SO_SNDBUF/SO_RCVBUF: setting them turns off the kernel's buffer autotuning
            # and is clamped to twice net.core.[rw]mem_max (416 KiB by default), which caps a
            # 50 ms link at a few MB/s; autotuning grows to tcp_[rw]mem (4-6 MiB by default).
            # On loopback (4 x 32M floats) fixed 8 MiB buffers measured the same daemon CPU.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.congestion:
                set_congestion(sock, self.congestion)
            set_keepalive(sock)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._target[self._filled:]

    def buffer_updated(self, nbytes: int) -> None:
        self._filled += nbytes
        self.bytes_in += nbytes
        self.last_in = timebase.monotonic()
        if not self.first_in:
            self.first_in = self.last_in
        if self._filled < self._want:
            return
        try:
            if self._frame is None:
                self._header_done()
            else:
                self._payload_done()
        except Exception as exc:  # a peer's bytes must never escape into the event loop
            self.abort(exc)

    def _header_done(self) -> None:
        kind, _flags, _reserved, part, length, aux = HEADER.unpack(self._hdr)
        if kind not in KINDS:
            raise DataPlaneError(f"unknown frame kind {kind}")
        plain = length
        if self.cipher is not None:
            plain -= TAG
            if plain < 0:
                raise TamperedFrame(f"sealed frame of {length} bytes, shorter than its tag")
            self._aad = bytes(self._hdr)
        limit = self.max_payload if kind in (PART, RESULT) else \
            MAX_CHECK_PAYLOAD if kind == CHECK else MAX_CONTROL_PAYLOAD
        if plain > limit:
            raise DataPlaneError(f"frame of {plain} bytes exceeds {limit}")
        self._frame = (kind, part, plain, aux, length)
        dest = (self.sink.buffer_for(kind, part, plain, aux) if self.sink is not None
                else None)
        if dest is None:
            dest = memoryview(bytearray(length))
        elif len(dest) < length:
            raise DataPlaneError("internal: destination buffer is too small")
        # Room past the payload (data frames) takes the next frame's header in the same read:
        # one recv per frame, not two. `_payload_done` moves those bytes to the header buffer.
        self._target, self._filled, self._want = dest[:length + HEADER.size], 0, length
        if length == 0:
            self._payload_done()

    def _payload_done(self) -> None:
        assert self._frame is not None
        kind, part, _plain, aux, length = self._frame
        payload = self._target[:length]
        spill = self._filled - length  # bytes of the next header that came along
        self._frame = None
        if spill:
            self._hdr[:spill] = self._target[length:self._filled]
        self._target, self._filled, self._want = memoryview(self._hdr), spill, HEADER.size
        if self.cipher is not None:  # an altered frame never reaches the sink
            payload = self.cipher.open_in_place(self._aad, payload)
        if self.sink is not None:
            self.sink.on_frame(kind, part, payload, aux)
        if spill == HEADER.size and not self.closed.done():  # (on_frame may have aborted)
            self._header_done()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._can_write.set()
        if not self.gone.done():
            self.gone.set_result(None)
        if not self.closed.done():
            self.closed.set_result(exc)
        if self.sink is not None:
            sink, self.sink = self.sink, None
            sink.on_close(exc if exc is not None else self.failure)

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    # --- sending ------------------------------------------------------------------------
    async def send(self, kind: int, part: int, *payload: memoryview | bytes, aux: int = 0,
                   then: Callable[[], None] | None = None) -> None:
        """Queue one frame; waits while the socket's buffer is full (flow control). Header
        and payloads go to the transport at once: uvloop sends them with one writev and keeps
        views of what the socket did not take yet (no copy; a 24-byte header written alone
        would cost a syscall and, with TCP_NODELAY, a packet of its own). `then` runs as soon
        as the frame is queued, before anything else can be received: a stream's last frame
        hands the connection on (session.py) before the peer can answer it."""
        if self.transport is None or self.transport.is_closing():
            raise DataPlaneError("connection closed")
        length = sum(len(p) for p in payload)
        if self.cipher is None:
            self.transport.writelines((HEADER.pack(kind, 0, 0, part, length, aux), *payload))
            self.bytes_out += HEADER.size + length
            self._written += HEADER.size + length
        else:  # sealed into a buffer that is reused once its bytes have left
            header = HEADER.pack(kind, 0, 0, part, length + TAG, aux)
            released = self._written - self.transport.get_write_buffer_size()
            buf = self.cipher.buffers.take(length + TAG, released)
            sealed = memoryview(buf)[:length + TAG]
            self.cipher.seal_into(header, payload, sealed)
            self.transport.writelines((header, sealed))
            self.bytes_out += HEADER.size + length + TAG
            self._written += HEADER.size + length + TAG
            self.cipher.buffers.hold(buf, self._written)
        if not self.first_out:
            self.first_out = timebase.monotonic()
        if then is not None:
            then()
        if not self._can_write.is_set():
            await self._can_write.wait()
        self.last_out = timebase.monotonic()  # the socket took all but its low-water mark

    def progress(self) -> int:
        """Bytes that really moved: received, plus sent minus what still waits in our write
        buffer (a large part on a slow link shows progress long before it is all out)."""
        pending = 0
        if self.transport is not None and not self.transport.is_closing():
            pending = self.transport.get_write_buffer_size()
        return self.bytes_in + self.bytes_out - pending

    def send_nowait(self, kind: int, part: int, payload: bytes = b"", aux: int = 0) -> None:
        if self.transport is not None and not self.transport.is_closing():
            if self.cipher is None:
                frame = HEADER.pack(kind, 0, 0, part, len(payload), aux) + payload
            else:
                header = HEADER.pack(kind, 0, 0, part, len(payload) + TAG, aux)
                frame = header + self.cipher.seal(header, payload)
            self.transport.write(frame)
            self.bytes_out += len(frame)
            self._written += len(frame)

    def abort(self, exc: BaseException | str, part: int = 0, code: int = 0) -> None:
        """Tell the peer why (best effort) and drop the connection."""
        message = str(exc).encode()[:MAX_CONTROL_PAYLOAD]
        log.debug("data channel aborted: %s", message.decode(errors="replace"))
        self.send_nowait(ABORT, part, message, aux=code)
        self.aborted = True
        if self.failure is None:
            self.failure = exc if isinstance(exc, BaseException) else DataPlaneError(exc)
        if self.transport is not None:
            self.transport.close()
        if not self.closed.done():
            self.closed.set_result(exc if isinstance(exc, BaseException)
                                   else DataPlaneError(str(exc)))

    def close(self) -> None:
        """Unsent bytes are dropped, not flushed: they are views of the trainer's buffer,
        which it may overwrite as soon as its round returns (the peer sees the connection
        drop and keeps its own values, instead of getting someone's next tensors). To have an
        ABORT arrive, `flush_aborts` first."""
        if self.transport is not None:
            if self.transport.get_write_buffer_size() > 0:
                self.transport.abort()
            else:
                self.transport.close()


async def flush_aborts(channels: list[Channel], timeout: float) -> None:
    """Until the ABORTs sent on these channels are out, or `timeout`: an ABORT is queued
    behind the frames written before it, and `close` would drop them all, so the peer would see
    the stream drop instead of hearing why. The frames ahead of it are views of the trainer's
    buffer: call this before the round returns, while the buffer is still the round's."""
    pending = [ch.gone for ch in channels if ch.aborted and not ch.gone.done()]
    if pending:
        await asyncio.wait(pending, timeout=timeout)


# s before a second connection attempt races the first. A lost SYN (or SYN-ACK) is resent
# after the kernel's initial retransmission timeout, 1 s, and every part of that member waits
# with it: on a 1 % lossy link, about one round in four had a member that late. Connections
# are usually up within a round trip; this is more than that on almost any path, so a healthy
# connect never races, and a lost SYN costs this instead of a second.
HEDGE_AFTER = 0.25


async def connect(host: str, port: int, sink: FrameSink, max_payload: int,
                  hedge_after: float = HEDGE_AFTER, congestion: str = "") -> Channel:
    """A connection to a peer's data plane: the first of two attempts to be up, the second
    started only if the first is not up after `hedge_after`. The loser never reaches the
    sink, whenever it is given up; an error is raised only when both attempts failed."""
    loop = asyncio.get_running_loop()
    made: dict[asyncio.Future[Channel], list[Channel]] = {}

    def attempt() -> asyncio.Future[Channel]:
        channels: list[Channel] = []

        def channel() -> Channel:  # it exists (and may be connected) before the result does
            channels.append(Channel(sink, max_payload, congestion))
            return channels[-1]

        async def run() -> Channel:
            return (await loop.create_connection(channel, host, port))[1]
        task = asyncio.ensure_future(run())
        made[task] = channels
        return task

    def discard(loser: asyncio.Future[Channel]) -> None:
        """Cut from the sink before anything closes it: a connection that asyncio closes
        because its attempt was cancelled must not tell the sink its stream is gone."""
        for ch in made[loser]:
            ch.sink = None
            if ch.transport is not None:
                ch.transport.close()
        if not loser.done():
            loser.cancel()
            loser.add_done_callback(lambda _: discard(loser))

    first = attempt()
    try:
        done, _ = await asyncio.wait({first}, timeout=hedge_after)
    except asyncio.CancelledError:
        discard(first)
        raise
    if done:
        return first.result()
    tries = [first, attempt()]
    pending = set(tries)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            won = next((t for t in done if t.exception() is None), None)
            if won is not None:
                for other in tries:
                    if other is not won:
                        discard(other)
                return won.result()
    except asyncio.CancelledError:
        for t in tries:
            discard(t)
        raise
    return tries[0].result()  # both failed: the first attempt's error


async def serve(host: str, port: int, accept: Callable[[], Channel]) -> asyncio.Server:
    loop = asyncio.get_running_loop()
    return await loop.create_server(accept, host, port, reuse_address=True)


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)
