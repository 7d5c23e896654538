"""Swarm key: a pre-shared secret that every message between daemons is authenticated with.

Like a libp2p private network: a daemon without the key can neither store nor read DHT records
nor join a group. Each message is sealed as

    timestamp (8 bytes, ms since the epoch) | nonce (12 random bytes) | payload | tag (32 bytes)

with tag = HMAC-SHA256(purpose key, context | timestamp | nonce | payload). The context binds a
tag to where the message is used (the gRPC method, the DHT, a data-plane HELLO and its sender),
so a sealed message cannot be replayed elsewhere. Receivers drop messages whose timestamp is
more than WINDOW seconds off their clock, and requests whose nonce they saw within the window.
The payload is authenticated, not encrypted: gRPC is encrypted by TLS, and data-plane streams
by their own handshake's keys (transport/handshake.py).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import struct
import time

WINDOW = 30.0  # seconds of clock skew plus delivery delay a message may show
NONCE = 12
TAG = 32
OVERHEAD = 8 + NONCE + TAG
MIN_SECRET = 16
MAX_REPLAY_ENTRIES = 200_000


class AuthError(Exception):
    """A message without a valid tag, outside the time window, or replayed."""


class ReplayCache:
    """Nonces of messages still inside the time window, each kept until its own timestamp
    leaves the window (so no replay inside the window is ever forgotten). Bounded: when full
    of live nonces, new messages are refused rather than old nonces dropped."""

    def __init__(self, window: float = WINDOW, max_entries: int = MAX_REPLAY_ENTRIES) -> None:
        self.window = window
        self.max_entries = max_entries
        self._seen: dict[bytes, float] = {}  # nonce -> when it can be forgotten

    def check(self, nonce: bytes, sent: float, now: float) -> None:
        if nonce in self._seen:
            raise AuthError("replayed message")
        if len(self._seen) >= self.max_entries:
            self._seen = {n: t for n, t in self._seen.items() if t > now}
            if len(self._seen) >= self.max_entries:
                raise AuthError("too many messages within the replay window")
        self._seen[nonce] = sent + self.window


class SwarmKey:
    def __init__(self, secret: bytes, window: float = WINDOW) -> None:
        if len(secret) < MIN_SECRET:
            raise ValueError(f"a swarm key needs at least {MIN_SECRET} bytes, got {len(secret)}")
        self.window = window
        # one key per purpose: a tag made for the DHT never verifies on gRPC or the data plane
        self._keys = {p: hmac.new(secret, b"moshpit/" + p, hashlib.sha256).digest()
                      for p in (b"dht", b"grpc", b"data", b"data-aead")}
        self.fingerprint = hashlib.sha256(b"moshpit/fingerprint" + secret).hexdigest()[:16]

    @classmethod
    def from_file(cls, path: str) -> SwarmKey:
        """The file holds the secret (any bytes; surrounding whitespace is ignored, so a hex or
        base64 line from `openssl rand -hex 32` works)."""
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                secret = f.read(1 << 16).strip()
        except OSError as exc:
            raise ValueError(f"cannot read swarm key file {path}: {exc.strerror}") from None
        if st.st_mode & (stat.S_IROTH | stat.S_IWOTH):
            raise ValueError(f"swarm key file {path} is readable or writable by others; "
                             "chmod 600 (or 640) it")
        return cls(secret)

    def subkey(self, purpose: bytes) -> bytes:
        """A secret of its own for `purpose`, derived from the swarm key (data-aead: mixed into
        the data plane's stream keys, transport/handshake.py)."""
        return self._keys[purpose]

    def _tag(self, purpose: bytes, context: bytes, *parts: bytes | memoryview) -> bytes:
        mac = hmac.new(self._keys[purpose], context, hashlib.sha256)
        for part in parts:  # fed in pieces: no concatenated copy of a large payload
            mac.update(part)
        return mac.digest()

    def seal(self, purpose: bytes, context: bytes, payload: bytes) -> bytes:
        head = struct.pack(">Q", int(time.time() * 1000)) + os.urandom(NONCE)
        return b"".join((head, payload, self._tag(purpose, context, head, payload)))

    def open(self, purpose: bytes, context: bytes, data: bytes | memoryview,
             replay: ReplayCache | None = None) -> bytes:
        """The payload, or AuthError. Check order: length, tag, time, nonce."""
        view = memoryview(data)
        if len(view) < OVERHEAD:
            raise AuthError("message too short to carry a swarm-key tag")
        head = bytes(view[:8 + NONCE])
        want = self._tag(purpose, context, view[:-TAG])
        if not hmac.compare_digest(bytes(view[-TAG:]), want):
            raise AuthError("bad swarm-key tag (another key, or a tampered message)")
        (ms,) = struct.unpack(">Q", head[:8])
        now = time.time()
        if abs(now - ms / 1000.0) > self.window:
            raise AuthError(f"message timestamp is {now - ms / 1000.0:+.1f} s off (window "
                            f"{self.window:.0f} s): clocks out of sync, or a replay")
        if replay is not None:
            replay.check(head[8:], ms / 1000.0, now)
        return bytes(view[8 + NONCE:-TAG])
