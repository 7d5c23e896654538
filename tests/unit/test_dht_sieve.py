"""The DHT socket's kernel filter, on real loopback sockets: what it drops, what it lets by."""

from __future__ import annotations

import os
import socket
import struct
import sys
import time
from collections.abc import Iterator

import pytest

from moshpitd.auth import OVERHEAD, ReplayCache, ReplayFull, SwarmKey
from moshpitd.dht.sieve import BAN_SECONDS, MAX_BANS, Sieve

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="socket filters are Linux's")


@pytest.fixture
def receiver() -> Iterator[socket.socket]:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.setblocking(False)
        yield sock


def delivered(receiver: socket.socket, datagrams: list[tuple[bytes, str, int]]) -> list[bytes]:
    """Sends each (payload, source address, source port or 0), then a marker from a fresh
    port that the filter lets by: everything sent before the marker has been filtered or
    queued once the marker is read (loopback delivers in order, in the sender's call)."""
    for payload, host, port in datagrams:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
            s.sendto(payload, receiver.getsockname())
    marker = sealed(b"marker")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.9", 0))
        s.sendto(marker, receiver.getsockname())
    got = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            data = receiver.recv(65536)
        except BlockingIOError:
            continue
        if data == marker:
            return got
        got.append(data)
    raise AssertionError("the marker never arrived")


KEY = SwarmKey(os.urandom(32))


def sealed(payload: bytes) -> bytes:
    return KEY.seal(b"dht", b"dht", payload)


def test_only_datagrams_shaped_like_sealed_ones_reach_the_daemon(
        receiver: socket.socket) -> None:
    sieve = Sieve(receiver, OVERHEAD)
    assert sieve.active
    good = sealed(b"x")
    junk = [b"\x01" + os.urandom(200), b"\x00\x05" + os.urandom(100), b"", good[:OVERHEAD - 1]]
    got = delivered(receiver, [(d, "127.0.0.1", 0) for d in [*junk, good]])
    assert got == [good]
    assert sieve.dropped() >= len(junk)


def test_a_blocked_sender_is_dropped_by_port_or_by_address_until_its_ban_ends(
        receiver: socket.socket) -> None:
    sieve = Sieve(receiver, OVERHEAD)
    now = 100.0
    assert sieve.ban("127.0.0.66", 40001, now)
    attached = sieve._attach
    sieve._attach = lambda: pytest.fail("the filter was loaded again")  # type: ignore[method-assign]
    assert sieve.ban("127.0.0.66", 40001, now + 1)  # already blocked: nothing to load
    sieve._attach = attached  # type: ignore[method-assign]
    a, b, c = sealed(b"a"), sealed(b"b"), sealed(b"c")
    got = delivered(receiver, [(a, "127.0.0.66", 40001), (b, "127.0.0.66", 40002),
                               (c, "127.0.0.1", 40001)])
    assert got == [b, c]  # the blocked port only
    assert sieve.ban("::ffff:127.0.0.66", None, now)  # the mapped form names the same address
    got = delivered(receiver, [(a, "127.0.0.66", 40001), (b, "127.0.0.66", 40002),
                               (c, "127.0.0.1", 40001)])
    assert got == [c]
    sieve.expire(now + BAN_SECONDS)
    assert sieve.bans == {}
    got = delivered(receiver, [(a, "127.0.0.66", 40001), (b, "127.0.0.66", 40002)])
    assert got == [a, b]


def test_a_block_is_renewed_while_the_replay_cache_still_refuses_its_sender(
        receiver: socket.socket) -> None:
    full = {("127.0.0.66", 40001): True, ("127.0.0.67", 0): True}
    asked: list[tuple[object, bool]] = []

    def still_full(sender: object, whole_address: bool) -> bool:
        asked.append((sender, whole_address))
        return full.get(sender, False)  # type: ignore[call-overload]

    sieve = Sieve(receiver, OVERHEAD, still_full)
    assert sieve.ban("127.0.0.66", 40001, 0.0, ("127.0.0.66", 40001))
    assert sieve.ban("127.0.0.67", None, 0.0, ("127.0.0.67", 0))
    sieve.expire(BAN_SECONDS)
    assert len(sieve.bans) == 2 and asked == [(("127.0.0.66", 40001), False),
                                              (("127.0.0.67", 0), True)]
    full[("127.0.0.66", 40001)] = False  # its nonces expired: let it through again
    sieve.expire(2 * BAN_SECONDS)
    assert [until for until, _ in sieve.bans.values()] == [3 * BAN_SECONDS]
    a, b = sealed(b"a"), sealed(b"b")
    assert delivered(receiver, [(a, "127.0.0.66", 40001), (b, "127.0.0.67", 5)]) == [a]


def test_bans_are_bounded_and_ipv6_senders_are_left_to_the_daemon(
        receiver: socket.socket) -> None:
    sieve = Sieve(receiver, OVERHEAD)
    for i in range(MAX_BANS):
        assert sieve.ban(f"127.0.1.{i}", None, 0.0 if i == 0 else 1.0)
    assert not sieve.ban("127.0.2.1", None, 1.0)  # full: the daemon refuses it itself
    assert sieve.ban("127.0.2.1", 5, BAN_SECONDS)  # ...until the oldest ban has ended
    assert not sieve.ban("::1", None, BAN_SECONDS)
    assert len(sieve.bans) == MAX_BANS
    # the longest program still loads, and still lets an unblocked sender by
    good = sealed(b"ok")
    assert delivered(receiver, [(good, "127.0.0.1", 0)]) == [good]


def test_the_replay_cache_says_which_share_is_full() -> None:
    cache = ReplayCache(max_entries=64, group_of=lambda s: s[0])  # type: ignore[index]
    now = 1000.0
    for i in range(cache.per_sender):
        cache.check(struct.pack(">Q", i), now, now, ("10.0.0.1", 1))
    with pytest.raises(ReplayFull) as full:
        cache.check(b"next", now, now, ("10.0.0.1", 1))
    assert full.value.scope == "sender"
    port = 2
    with pytest.raises(ReplayFull) as full:
        while True:
            cache.check(os.urandom(8), now, now, ("10.0.0.1", port))
            port += 1
    assert full.value.scope == "group"
    assert cache.full(("10.0.0.1", 1), False, now) and cache.full(("10.0.0.1", 9), True, now)
    assert not cache.full(("10.0.0.1", 9), False, now)
    assert not cache.full(("10.0.0.2", 1), True, now)
    later = now + cache.window + 2  # every nonce expired
    assert not cache.full(("10.0.0.1", 1), False, later)
    assert not cache.full(("10.0.0.1", 1), True, later)
