"""The handshake that opens a data-plane stream: each side proves its peer key, and both derive
the stream's keys.

A stream goes from sender k to the owner (reducer) j of a group both hold. The frames are:

    HELLO (k -> j), part = j, aux = k, payload sealed with the swarm key when there is one:
        version u8 | mode u8 | group id (16) | k's public key (32) | ephemeral (32) |
        time ms u64 | signature (64)
        signed by k over  "moshpit/data-hello/1\\0" | group digest (32) | k u32 | j u32 |
                          mode | k's public key | ephemeral | time ms
    READY (j -> k):
        j's public key (32) | ephemeral (32) | signature (64)
        signed by j over  "moshpit/data-ready/1\\0" | SHA-256(HELLO, unsealed) |
                          j's public key | ephemeral

The owner takes the stream as sender k only if k's key hashes to member k's peer id in the
group it holds and the signature verifies; the group digest covers every member's id, weight
and endpoints, so members shown different groups under one id do not connect. The sender
streams to j only once j's READY proves j's key and answers this very HELLO. (This module sees
a group as its callers pass it: the id streams are routed by, the digest both sides must hold,
and peer ids. It knows nothing else of groups or rounds.)

mode 1 (encrypted) makes both ephemerals X25519 keys; then
    keys = HKDF-SHA256(X25519(e_k, e_j), salt = the swarm key's data-plane key (or none),
                       info = "moshpit/data-keys/1\\0" | SHA-256(HELLO | READY), 96 bytes)
the first 32 bytes key k -> j, the next 32 j -> k, and every later frame is sealed
(framecrypt.py); the last 32 are the secret of the session the connection becomes once the
stream ends (session.py), from which later streams on it take their keys.
mode 0 (data_encryption = "off", or neither a swarm key nor TLS) carries random nonces
instead: the handshake is still authenticated, the frames after it are not.
Each handshake is fresh (an ephemeral key, a time): its signatures are verified once, and
there is nothing to cache. A HELLO's signature is checked only once the owner holds the group,
and only if the sender's slot is free; a replayed HELLO is refused by its ephemeral.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from moshpitd import timebase
from moshpitd.auth import OVERHEAD, WINDOW, AuthError, ReplayCache, SwarmKey, timestamp_error
from moshpitd.identity import PeerKey, peer_id_of, verify
from moshpitd.transport.framecrypt import KEY_BYTES, FrameCipher
from moshpitd.transport.session import SECRET_BYTES, Session

VERSION = 1
PLAIN, ENCRYPTED = 0, 1
HELLO_DOMAIN = b"moshpit/data-hello/1\x00"
READY_DOMAIN = b"moshpit/data-ready/1\x00"
KEYS_DOMAIN = b"moshpit/data-keys/1\x00"
HELLO_FORMAT = struct.Struct(">BB16s32s32sQ64s")
READY_FORMAT = struct.Struct(">32s32s64s")
INDEX = struct.Struct(">II")


class HandshakeError(Exception):
    """A stream's handshake does not prove who opened or answers it."""


class UnsealedHello(HandshakeError):
    """A HELLO without a valid swarm-key tag: counted as refused by the swarm key."""


@dataclass(frozen=True)
class Hello:
    """A HELLO as the owner reads it before it knows the group: checked for form, time and
    replay, not yet for its signature (that needs the group's members)."""

    group_id: bytes
    mode: int
    public: bytes
    ephemeral: bytes
    sent_ms: int
    signature: bytes
    raw: bytes  # unsealed, as signed

    @property
    def route(self) -> bytes:
        """The id its stream is routed by (a group's)."""
        return self.group_id

    def signed(self, digest: bytes, sender: int, receiver: int) -> bytes:
        return (HELLO_DOMAIN + digest + INDEX.pack(sender & 0xFFFFFFFF, receiver & 0xFFFFFFFF)
                + bytes([self.mode]) + self.public + self.ephemeral
                + self.sent_ms.to_bytes(8, "big"))


@dataclass
class Pending:
    """Our side of a stream we opened, until the owner's READY."""

    hello: bytes
    owner_id: bytes
    mode: int
    secret: X25519PrivateKey | None


def _context(sender: int, receiver: int) -> bytes:
    return b"hello" + INDEX.pack(sender & 0xFFFFFFFF, receiver & 0xFFFFFFFF)


class Handshake:
    """One daemon's side of every data-plane handshake: its peer key, the swarm key (if any)
    and whether its streams are encrypted."""

    def __init__(self, key: PeerKey | None = None, swarm: SwarmKey | None = None,
                 encrypt: bool = False, window: float = WINDOW) -> None:
        self.key = key or PeerKey.generate()
        self.swarm = swarm
        self.mode = ENCRYPTED if encrypt else PLAIN
        self.window = window
        self.replay = ReplayCache(window)  # HELLOs' ephemerals, so each opens one stream
        self._salt = swarm.subkey(b"data-aead") if swarm is not None else None
        self.hello_length = HELLO_FORMAT.size + (OVERHEAD if swarm is not None else 0)

    # --- the sender's side ---------------------------------------------------------------
    def hello(self, route: bytes, digest: bytes, owner_id: bytes, sender: int, receiver: int
              ) -> tuple[bytes, Pending]:
        """The HELLO payload that opens our stream to member `receiver` (peer `owner_id`) of
        the group `route` with that digest, and what we keep to check its READY."""
        secret = X25519PrivateKey.generate() if self.mode == ENCRYPTED else None
        ephemeral = (secret.public_key().public_bytes_raw() if secret is not None
                     else os.urandom(32))
        draft = Hello(route, self.mode, self.key.public, ephemeral,
                      int(timebase.wall() * 1000), b"", b"")
        signature = self.key.sign(draft.signed(digest, sender, receiver))
        raw = HELLO_FORMAT.pack(VERSION, self.mode, route, self.key.public, ephemeral,
                                draft.sent_ms, signature)
        wire = raw if self.swarm is None else self.swarm.seal(b"data", _context(sender, receiver),
                                                              raw)
        return wire, Pending(raw, owner_id, self.mode, secret)

    def finish(self, pending: Pending, ready: bytes | memoryview
               ) -> tuple[FrameCipher | None, Session]:
        """Check the owner's READY; the stream's cipher (None in mode 0), and the session the
        connection becomes once the stream ends."""
        if len(ready) != READY_FORMAT.size:
            raise HandshakeError(f"READY of {len(ready)} bytes, not {READY_FORMAT.size}")
        public, ephemeral, signature = READY_FORMAT.unpack(ready)
        if peer_id_of(public) != pending.owner_id:
            raise HandshakeError("the owner's key is not the peer id the group lists for it")
        answered = READY_DOMAIN + hashlib.sha256(pending.hello).digest() + public + ephemeral
        if not verify(public, signature, answered):
            raise HandshakeError("the owner's READY signature does not verify")
        if pending.secret is None:
            return None, Session(pending.owner_id, None, opener=True)
        shared = self._exchange(pending.secret, ephemeral)
        k_out, k_in, session = self._keys(shared, pending.hello, bytes(ready))
        return FrameCipher(k_out, k_in), Session(pending.owner_id, session, opener=True)

    # --- the owner's side ----------------------------------------------------------------
    def open_hello(self, payload: bytes | memoryview, sender: int, receiver: int) -> Hello:
        """A HELLO's fields, once its swarm-key tag, form, mode, time and freshness check out
        (UnsealedHello or HandshakeError otherwise)."""
        if self.swarm is not None:
            try:
                payload = self.swarm.open(b"data", _context(sender, receiver), payload)
            except AuthError as exc:
                raise UnsealedHello(f"unauthenticated data-plane stream: {exc}") from None
        if len(payload) != HELLO_FORMAT.size:
            raise HandshakeError(f"HELLO of {len(payload)} bytes, not {HELLO_FORMAT.size}")
        version, mode, group_id, public, ephemeral, sent_ms, signature = HELLO_FORMAT.unpack(
            payload)
        if version != VERSION:
            raise HandshakeError(f"handshake version {version}, not {VERSION}")
        if mode != self.mode:
            raise HandshakeError(
                "the sender " + ("encrypts" if mode else "does not encrypt") + " its stream "
                "and this daemon " + ("does" if self.mode else "does not") + ": every daemon of "
                "a swarm needs the same data_encryption, swarm_key_file and TLS settings")
        now = timebase.wall()
        if (why := timestamp_error(sent_ms / 1000.0, now, self.window)) is not None:
            raise HandshakeError("HELLO " + why)
        return Hello(group_id, mode, public, ephemeral, sent_ms, signature, bytes(payload))

    def accept(self, hello: Hello, digest: bytes, sender_id: bytes, sender: int, receiver: int
               ) -> tuple[bytes, FrameCipher | None, Session]:
        """Our READY for a stream that proves to be member `sender`'s (peer `sender_id`, in
        the group of that digest), its cipher, and the session the connection becomes."""
        if peer_id_of(hello.public) != sender_id:
            raise HandshakeError(f"its key is not member {sender}'s")
        if not verify(hello.public, hello.signature, hello.signed(digest, sender, receiver)):
            raise HandshakeError(f"its signature as member {sender} does not verify (another "
                                 "key, or another view of the group)")
        try:  # after the signature: only genuine HELLOs take room in the cache
            self.replay.check(hello.ephemeral, hello.sent_ms / 1000.0, timebase.wall(),
                              hello.public)
        except AuthError as exc:
            raise HandshakeError(f"HELLO {exc}") from None
        secret = X25519PrivateKey.generate() if hello.mode == ENCRYPTED else None
        ephemeral = (secret.public_key().public_bytes_raw() if secret is not None
                     else os.urandom(32))
        answered = READY_DOMAIN + hashlib.sha256(hello.raw).digest() + self.key.public + ephemeral
        ready = READY_FORMAT.pack(self.key.public, ephemeral, self.key.sign(answered))
        if secret is None:
            return ready, None, Session(sender_id, None, opener=False)
        shared = self._exchange(secret, hello.ephemeral)
        k_in, k_out, session = self._keys(shared, hello.raw, ready)
        return ready, FrameCipher(k_out, k_in), Session(sender_id, session, opener=False)

    # --- keys ----------------------------------------------------------------------------
    @staticmethod
    def _exchange(secret: X25519PrivateKey, peer: bytes) -> bytes:
        try:
            return secret.exchange(X25519PublicKey.from_public_bytes(peer))
        except ValueError as exc:  # a low-order point: no shared secret
            raise HandshakeError(f"unusable ephemeral key: {exc}") from None

    def _keys(self, shared: bytes, hello: bytes, ready: bytes) -> tuple[bytes, bytes, bytes]:
        """(sender -> owner key, owner -> sender key, session secret)."""
        transcript = hashlib.sha256(hello + ready).digest()
        okm = HKDF(hashes.SHA256(), 2 * KEY_BYTES + SECRET_BYTES, self._salt,
                   KEYS_DOMAIN + transcript).derive(shared)
        return okm[:KEY_BYTES], okm[KEY_BYTES:2 * KEY_BYTES], okm[2 * KEY_BYTES:]
