"""Swarm-key sealing: what opens, and every way a message is refused."""

from __future__ import annotations

import os
import struct
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moshpitd.auth import OVERHEAD, AuthError, ReplayCache, SwarmKey

KEY = SwarmKey(b"k" * 32)


@given(st.binary(max_size=2000), st.binary(max_size=64))
@settings(max_examples=200, deadline=None)
def test_seal_then_open_roundtrips(payload: bytes, context: bytes) -> None:
    sealed = KEY.seal(b"dht", context, payload)
    assert len(sealed) == len(payload) + OVERHEAD
    assert KEY.open(b"dht", context, sealed) == payload


@given(st.binary(min_size=1, max_size=200), st.integers(min_value=0), st.integers(0, 7))
@settings(max_examples=300, deadline=None)
def test_any_flipped_bit_is_refused(payload: bytes, where: int, bit: int) -> None:
    sealed = bytearray(KEY.seal(b"grpc", b"ctx", payload))
    sealed[where % len(sealed)] ^= 1 << bit
    with pytest.raises(AuthError):
        KEY.open(b"grpc", b"ctx", bytes(sealed))


def test_other_key_purpose_or_context_is_refused() -> None:
    sealed = KEY.seal(b"grpc", b"/moshpit.Averager/Join", b"payload")
    with pytest.raises(AuthError, match="tag"):
        SwarmKey(b"x" * 32).open(b"grpc", b"/moshpit.Averager/Join", sealed)
    with pytest.raises(AuthError, match="tag"):
        KEY.open(b"dht", b"/moshpit.Averager/Join", sealed)
    with pytest.raises(AuthError, match="tag"):
        KEY.open(b"grpc", b"/moshpit.Averager/DownloadState", sealed)
    with pytest.raises(AuthError, match="too short"):
        KEY.open(b"grpc", b"", b"short")


def test_stale_or_future_timestamps_are_refused() -> None:
    import time
    for skew in (-40.0, 40.0):
        with mock.patch("moshpitd.auth.time.time", return_value=time.time() + skew):
            sealed = KEY.seal(b"dht", b"dht", b"x")
        with pytest.raises(AuthError, match="off"):
            KEY.open(b"dht", b"dht", sealed)
    with mock.patch("moshpitd.auth.time.time", return_value=time.time() - 10):
        assert KEY.open(b"dht", b"dht", KEY.seal(b"dht", b"dht", b"x")) == b"x"
    # the timestamp is covered by the tag: moving it forward does not help
    sealed = bytearray(KEY.seal(b"dht", b"dht", b"x"))
    sealed[:8] = struct.pack(">Q", 0)
    with pytest.raises(AuthError, match="tag"):
        KEY.open(b"dht", b"dht", bytes(sealed))


def test_replays_are_refused_and_the_cache_stays_bounded() -> None:
    cache = ReplayCache(max_entries=100)
    sealed = KEY.seal(b"dht", b"dht", b"ping")
    assert KEY.open(b"dht", b"dht", sealed, cache) == b"ping"
    with pytest.raises(AuthError, match="replayed"):
        KEY.open(b"dht", b"dht", sealed, cache)
    for _ in range(99):
        KEY.open(b"dht", b"dht", KEY.seal(b"dht", b"dht", b"x"), cache)
    # full of nonces still inside the window: refuse, never forget one that could be replayed
    with pytest.raises(AuthError, match="too many"):
        KEY.open(b"dht", b"dht", KEY.seal(b"dht", b"dht", b"x"), cache)
    assert len(cache._seen) == 100
    with pytest.raises(AuthError, match="replayed"):
        KEY.open(b"dht", b"dht", sealed, cache)
    import time
    with mock.patch("moshpitd.auth.time.time", return_value=time.time() + 31):
        fresh = KEY.seal(b"dht", b"dht", b"x")
        assert KEY.open(b"dht", b"dht", fresh, cache) == b"x"  # expired nonces made room
    assert len(cache._seen) == 1


def test_secret_rules() -> None:
    with pytest.raises(ValueError, match="at least 16"):
        SwarmKey(b"short")
    assert SwarmKey(b"a" * 16).fingerprint != SwarmKey(b"b" * 16).fingerprint
    assert SwarmKey(os.urandom(16)).fingerprint != KEY.fingerprint
