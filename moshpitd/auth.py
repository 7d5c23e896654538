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
from collections.abc import Callable

from moshpitd import timebase

WINDOW = 30.0  # seconds a message may be late: delivery delay plus a slow sender's clock
# Seconds a message may be dated ahead of our clock. Its nonce must be kept until its date
# leaves the window, so this bounds how long a message can make us hold it (WINDOW + this).
FUTURE_SKEW = 5.0
NONCE = 12
TAG = 32
OVERHEAD = 8 + NONCE + TAG
MIN_SECRET = 16
MAC_CONTEXTS = 64  # keyed MACs kept, one per (purpose, context)
MAX_REPLAY_ENTRIES = 200_000
# One sender's share of a cache: a sender that fills its own share is refused, and everyone
# else's messages still fit.
REPLAY_SENDER_SHARE = 1 / 16
# One group of senders' share (the DHT's: every port of one address), loose, since peers behind
# one NAT, and every daemon of a test on 127.0.0.1, share an address. One machine has 64k
# ports: without it, 32 of them filled a cache and the daemon refused every datagram.
REPLAY_GROUP_SHARE = 1 / 4


class AuthError(Exception):
    """A message without a valid tag, outside the time window, or replayed."""


class ReplayFull(AuthError):
    """A message refused because the replay cache, its sender's share or its sender's group's
    share is full of live nonces: `scope` says which ("total", "sender", "group")."""

    def __init__(self, message: str, scope: str) -> None:
        super().__init__(message)
        self.scope = scope


def timestamp_error(sent: float, now: float, window: float = WINDOW) -> str | None:
    """Why a message dated `sent` is refused at `now`, or None: at most `window` seconds late,
    at most FUTURE_SKEW early."""
    if -window <= sent - now <= FUTURE_SKEW:
        return None
    return (f"timestamp is {sent - now:+.1f} s off our clock (allowed: {window:.0f} s late, "
            f"{FUTURE_SKEW:.0f} s early): clocks out of sync, or a replay")


class ReplayCache:
    """Nonces of messages still inside the time window, each kept until its own timestamp
    leaves the window, so no replay inside the window is ever forgotten.

    Constant time per message: nonces are filed in one-second buckets by when they may be
    forgotten, and each check first drops the buckets whose second has passed (every bucket
    is dropped once, so the work is amortized over the messages that filled it); nothing is
    ever rebuilt. Bounded twice: in total (`max_entries`), and per sender (`per_sender`, a
    share of the total), so that one sender filling the cache cannot refuse everyone else's
    messages. When the cache, or a sender's share, is full of live nonces, new messages are
    refused (never an old nonce forgotten early, which would let its message be replayed)
    until their nonces expire: at most WINDOW + FUTURE_SKEW seconds."""

    def __init__(self, window: float = WINDOW, max_entries: int = MAX_REPLAY_ENTRIES,
                 per_sender: int | None = None,
                 group_of: Callable[[object], object] | None = None) -> None:
        """`group_of`: the group a sender belongs to (its address, for a sender that is an
        address and port), held to REPLAY_GROUP_SHARE of the total; None: no groups."""
        self.window = window
        self.max_entries = max_entries
        self.per_sender = per_sender or max(1, int(max_entries * REPLAY_SENDER_SHARE))
        self.group_of = group_of
        self.per_group = max(1, int(max_entries * REPLAY_GROUP_SHARE))
        self._by_group: dict[object, int] = {}
        self._seen: dict[bytes, tuple[int, object]] = {}  # nonce -> (bucket, sender)
        self._buckets: dict[int, list[bytes]] = {}  # second when forgotten -> nonces
        self._swept = -1  # every bucket up to this second is gone
        self._by_sender: dict[object, int] = {}
        self.refused_full = 0  # refused because the cache or the sender's share was full

    def __len__(self) -> int:
        return len(self._seen)

    def _sweep(self, now: float) -> None:
        second = int(now)
        if self._swept < 0:
            self._swept = second - 1
        if second - self._swept > len(self._buckets):  # a long gap: visit buckets, not seconds
            for due in [b for b in self._buckets if b <= second]:
                self._drop(due)
        else:
            for due in range(self._swept + 1, second + 1):
                self._drop(due)
        self._swept = max(self._swept, second)

    def _drop(self, bucket: int) -> None:
        for nonce in self._buckets.pop(bucket, ()):
            _, sender = self._seen.pop(nonce)
            _uncount(self._by_sender, sender)
            if self.group_of is not None:
                _uncount(self._by_group, self.group_of(sender))

    def full(self, sender: object, whole_group: bool, now: float) -> bool:
        """Whether a message from `sender` (or from any sender of its group) would be refused
        now for a full share."""
        self._sweep(now)
        if whole_group:
            return self.group_of is not None and \
                self._by_group.get(self.group_of(sender), 0) >= self.per_group
        return self._by_sender.get(sender, 0) >= self.per_sender

    def check(self, nonce: bytes, sent: float, now: float, sender: object = None) -> None:
        """Refuses a replay, or a message that does not fit; else remembers its nonce.
        `sender`: whoever the caller can tell apart (an address, a peer id) for the quota;
        None: a caller that cannot tell (a gRPC deserializer), held to the total only."""
        self._sweep(now)
        if nonce in self._seen:
            raise AuthError("replayed message")
        if len(self._seen) >= self.max_entries:
            self.refused_full += 1
            raise ReplayFull("too many messages within the replay window", "total")
        if sender is not None and self._by_sender.get(sender, 0) >= self.per_sender:
            self.refused_full += 1
            raise ReplayFull("too many messages from this sender within the replay window",
                             "sender")
        group = None if self.group_of is None or sender is None else self.group_of(sender)
        if group is not None:
            if self._by_group.get(group, 0) >= self.per_group:
                self.refused_full += 1
                raise ReplayFull("too many messages from this address within the replay "
                                 "window", "group")
            self._by_group[group] = self._by_group.get(group, 0) + 1
        # forgotten in the first whole second after its date leaves the window (never early),
        # and never before the next sweep: a message dated far back still waits one second
        bucket = max(int(sent + self.window) + 1, self._swept + 1)
        self._seen[nonce] = (bucket, sender)
        self._buckets.setdefault(bucket, []).append(nonce)
        self._by_sender[sender] = self._by_sender.get(sender, 0) + 1


def _uncount(counts: dict[object, int], who: object) -> None:
    left = counts.get(who, 0) - 1
    if left > 0:
        counts[who] = left
    else:
        counts.pop(who, None)


class SwarmKey:
    def __init__(self, secret: bytes, window: float = WINDOW) -> None:
        if len(secret) < MIN_SECRET:
            raise ValueError(f"a swarm key needs at least {MIN_SECRET} bytes, got {len(secret)}")
        self.window = window
        # one key per purpose: a tag made for the DHT never verifies on gRPC or the data plane
        self._keys = {p: hmac.new(secret, b"moshpit/" + p, hashlib.sha256).digest()
                      for p in (b"dht", b"grpc", b"data", b"data-aead")}
        self.fingerprint = hashlib.sha256(b"moshpit/fingerprint" + secret).hexdigest()[:16]
        self._macs: dict[tuple[bytes, bytes], hmac.HMAC] = {}

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
        # a copy of a MAC already keyed and fed its context: a third of hmac.new's cost, paid
        # on every datagram a stranger sends (the contexts are a handful of constants)
        base = self._macs.get((purpose, context))
        if base is None:
            if len(self._macs) >= MAC_CONTEXTS:
                self._macs.clear()
            base = self._macs[purpose, context] = hmac.new(self._keys[purpose], context,
                                                           hashlib.sha256)
        mac = base.copy()
        for part in parts:  # fed in pieces: no concatenated copy of a large payload
            mac.update(part)
        return mac.digest()

    def seal(self, purpose: bytes, context: bytes, payload: bytes) -> bytes:
        head = struct.pack(">Q", int(timebase.wall() * 1000)) + os.urandom(NONCE)
        return b"".join((head, payload, self._tag(purpose, context, head, payload)))

    def open(self, purpose: bytes, context: bytes, data: bytes | memoryview,
             replay: ReplayCache | None = None, sender: object = None) -> bytes:
        """The payload, or AuthError. Check order: length, time, tag, nonce (the date first:
        it costs a tenth of the tag, and random junk fails it)."""
        view = memoryview(data)
        if len(view) < OVERHEAD:
            raise AuthError("message too short to carry a swarm-key tag")
        head = bytes(view[:8 + NONCE])
        (ms,) = struct.unpack(">Q", head[:8])
        now = timebase.wall()
        if (why := timestamp_error(ms / 1000.0, now, self.window)) is not None:
            raise AuthError("message " + why)
        want = self._tag(purpose, context, view[:-TAG])
        if not hmac.compare_digest(bytes(view[-TAG:]), want):
            raise AuthError("bad swarm-key tag (another key, or a tampered message)")
        if replay is not None:
            replay.check(head[8:], ms / 1000.0, now, sender)
        return bytes(view[8 + NONCE:-TAG])
