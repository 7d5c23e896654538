"""Sessions: a data-plane connection whose first stream proved both peer keys, kept open after
its stream ends so that the next stream between the same two daemons needs no connect and no
handshake.

The first stream on a connection runs the signed handshake (handshake.py); its key exchange
also yields a session secret. Once that stream has ended cleanly on both sides (every frame
each way delivered, nothing left in the send buffer), the connection goes idle: the side that
opened it keeps it in its `SessionPool` under the peer's endpoint and proven id, the side that
accepted it waits on it for the next stream (allreduce/registry.py). A later stream opens with
one ATTACH frame instead of a HELLO and is answered by READY:

    ATTACH (opener -> acceptor): route id (16) | context digest (32) | sender u32 | receiver u32

Between streams a session's frames are sealed with its control keys (both derived from the
secret, nonces counting on across streams); from the READY on, the stream's frames are sealed
with keys derived from the secret, the caller's context (for a round: its group's digest and
the two members' indices) and the number of streams the session carried before. A frame of one
stream is therefore never taken for another's, on this session or any other. This module knows
nothing of groups or rounds: the context is opaque bytes.

With encryption off (handshake mode 0) there is no secret: ATTACH and everything after it go in
the clear, as the frames after a plain handshake do.
"""

from __future__ import annotations

import asyncio
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from moshpitd.transport.framecrypt import KEY_BYTES, FrameCipher


class Kept(Protocol):
    """What sessions need of a connection (transport/dataplane.py's Channel)."""

    session: Session | None
    cipher: FrameCipher | None
    sink: Any

    def is_open(self) -> bool: ...

    def close(self) -> None: ...


SECRET_BYTES = 32
ATTACH = struct.Struct(">16s32sII")
CONTROL_DOMAIN = b"moshpit/session-control/1\x00"
STREAM_DOMAIN = b"moshpit/session-stream/1\x00"
# s an idle session stays open on the side that opened it; the side that accepted it waits a
# little longer, so that the opener, which decides when to reuse it, closes it first
IDLE_SECONDS = 60.0
ACCEPTED_IDLE_SECONDS = IDLE_SECONDS + 15.0
MAX_PER_PEER = 4  # idle sessions the pool keeps to one peer (a round uses one per owner)
MAX_IDLE = 256  # idle sessions in all, on each side; the oldest is closed past it


def stream_context(digest: bytes, sender: int, receiver: int) -> bytes:
    """What a stream's keys are bound to besides its session: the digest both ends hold of
    what the stream is for, and which end sends to which."""
    return digest + struct.pack(">II", sender & 0xFFFFFFFF, receiver & 0xFFFFFFFF)


@dataclass(frozen=True)
class Attach:
    """A later stream's first frame, as the acceptor reads it (already opened with the
    session's control keys)."""

    route: bytes
    digest: bytes
    sender: int
    receiver: int

    def pack(self) -> bytes:
        return ATTACH.pack(self.route, self.digest, self.sender, self.receiver)

    @classmethod
    def unpack(cls, payload: bytes | memoryview) -> Attach:
        route, digest, sender, receiver = ATTACH.unpack(payload)
        return cls(route, digest, sender, receiver)


@dataclass(eq=False)
class Session:
    """One end of a session: the peer it proved to be, and the keys it derives.

    `opener` is whether this end opened the connection (its keys are the first half of each
    derivation, as in the handshake)."""

    peer_id: bytes
    secret: bytes | None  # None: encryption is off, nothing is sealed
    opener: bool
    streams: int = 0  # streams this session carried before the current one
    control: FrameCipher | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.secret is not None:
            self.control = self._cipher(CONTROL_DOMAIN)

    def next_stream(self, context: bytes) -> FrameCipher | None:
        """The cipher of the stream that starts now on this session (both ends call it once
        per stream, at the READY, in the same order)."""
        self.streams += 1
        if self.secret is None:
            return None
        return self._cipher(STREAM_DOMAIN + struct.pack(">Q", self.streams) + context)

    def _cipher(self, info: bytes) -> FrameCipher:
        assert self.secret is not None
        okm = HKDF(hashes.SHA256(), 2 * KEY_BYTES, None, info).derive(self.secret)
        mine, theirs = okm[:KEY_BYTES], okm[KEY_BYTES:]
        return FrameCipher(mine, theirs) if self.opener else FrameCipher(theirs, mine)


C = TypeVar("C", bound=Kept)


class Idle(Generic[C]):
    """What an idle session's connection hears: nothing is expected until the opener attaches
    a stream, so any frame ends the session, and its closing just takes it out of the pool."""

    def __init__(self, pool: SessionPool[C], key: tuple[str, bytes], channel: C) -> None:
        self.pool, self.key, self.channel = pool, key, channel

    def buffer_for(self, kind: int, part: int, length: int, aux: int) -> memoryview | None:
        raise SessionError(f"frame kind {kind} on an idle session")

    def on_frame(self, kind: int, part: int, payload: memoryview, aux: int) -> None:
        pass

    def on_close(self, exc: BaseException | None) -> None:
        self.pool.forget(self.key, self.channel)


class SessionError(Exception):
    """A peer broke the session protocol (a frame while idle, a malformed ATTACH)."""


class SessionPool(Generic[C]):
    """The idle sessions this daemon opened, by (endpoint, peer id), newest last; each closes
    after IDLE_SECONDS unused. Bounded per peer and in all: a round takes one per owner."""

    def __init__(self, idle_seconds: float = IDLE_SECONDS, max_per_peer: int = MAX_PER_PEER,
                 max_idle: int = MAX_IDLE) -> None:
        self.idle_seconds, self.max_per_peer, self.max_idle = idle_seconds, max_per_peer, max_idle
        self._idle: OrderedDict[tuple[tuple[str, bytes], C], asyncio.TimerHandle] = \
            OrderedDict()

    def __len__(self) -> int:
        return len(self._idle)

    def keep(self, endpoint: str, channel: C) -> None:
        """A stream ended cleanly on `channel`, which we opened: keep it for the next one."""
        session = channel.session
        if session is None or not channel.is_open():
            channel.close()
            return
        key = (endpoint, session.peer_id)
        channel.cipher = session.control
        channel.sink = Idle(self, key, channel)
        timer = asyncio.get_running_loop().call_later(self.idle_seconds, self._expire, key,
                                                      channel)
        self._idle[key, channel] = timer
        same = [c for k, c in self._idle if k == key]
        for old in same[:max(0, len(same) - self.max_per_peer)]:
            self._drop(key, old)
        while len(self._idle) > self.max_idle:
            (k, old), _ = next(iter(self._idle.items()))
            self._drop(k, old)

    def take(self, endpoint: str, peer_id: bytes) -> C | None:
        """An idle session to that peer at that endpoint, now no longer idle, or None."""
        key = (endpoint, peer_id)
        for k, channel in reversed(list(self._idle)):
            if k != key:
                continue
            timer = self._idle.pop((k, channel))
            timer.cancel()
            if channel.is_open():
                return channel
            channel.close()
        return None

    def forget(self, key: tuple[str, bytes], channel: C) -> None:
        timer = self._idle.pop((key, channel), None)
        if timer is not None:
            timer.cancel()

    def _expire(self, key: tuple[str, bytes], channel: C) -> None:
        self._drop(key, channel)

    def _drop(self, key: tuple[str, bytes], channel: C) -> None:
        self.forget(key, channel)
        channel.close()

    def close(self) -> None:
        for (key, channel) in list(self._idle):
            self._drop(key, channel)
