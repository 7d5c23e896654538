"""Swarm-key sealing: what opens, and every way a message is refused."""

from __future__ import annotations

import os
import struct
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moshpitd.auth import FUTURE_SKEW, OVERHEAD, AuthError, ReplayCache, SwarmKey

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
        with mock.patch("moshpitd.timebase.time.time", return_value=time.time() + skew):
            sealed = KEY.seal(b"dht", b"dht", b"x")
        with pytest.raises(AuthError, match="off"):
            KEY.open(b"dht", b"dht", sealed)
    with mock.patch("moshpitd.timebase.time.time", return_value=time.time() - 10):
        assert KEY.open(b"dht", b"dht", KEY.seal(b"dht", b"dht", b"x")) == b"x"
    # the timestamp is covered by the tag: moving it, even within the window, does not help
    sealed = bytearray(KEY.seal(b"dht", b"dht", b"x"))
    (ms,) = struct.unpack(">Q", sealed[:8])
    sealed[:8] = struct.pack(">Q", ms + 1000)
    with pytest.raises(AuthError, match="tag"):
        KEY.open(b"dht", b"dht", bytes(sealed))
    # and the date is read first: junk dated outside the window costs no MAC
    sealed[:8] = struct.pack(">Q", 0)
    with mock.patch.object(KEY, "_tag", side_effect=AssertionError("MAC computed")), \
            pytest.raises(AuthError, match="off"):
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
    with mock.patch("moshpitd.timebase.time.time", return_value=time.time() + 31):
        fresh = KEY.seal(b"dht", b"dht", b"x")
        assert KEY.open(b"dht", b"dht", fresh, cache) == b"x"  # expired nonces made room
    assert len(cache._seen) == 1


def test_secret_rules() -> None:
    with pytest.raises(ValueError, match="at least 16"):
        SwarmKey(b"short")
    assert SwarmKey(b"a" * 16).fingerprint != SwarmKey(b"b" * 16).fingerprint
    assert SwarmKey(os.urandom(16)).fingerprint != KEY.fingerprint


def test_a_message_dated_ahead_is_refused_past_the_future_skew() -> None:
    import time
    now = time.time()
    for ahead, ok in ((FUTURE_SKEW - 0.5, True), (FUTURE_SKEW + 0.5, False), (29.5, False)):
        with mock.patch("moshpitd.timebase.time.time", return_value=now + ahead):
            sealed = KEY.seal(b"dht", b"dht", b"x")
        if ok:
            assert KEY.open(b"dht", b"dht", sealed, ReplayCache()) == b"x"
        else:
            with pytest.raises(AuthError, match="early"):
                KEY.open(b"dht", b"dht", sealed, ReplayCache())


def test_one_sender_filling_its_share_leaves_room_for_the_others() -> None:
    cache = ReplayCache(max_entries=64, per_sender=16)
    for i in range(16):
        cache.check(b"a%d" % i, 100.0, 100.0, "flooder")
    with pytest.raises(AuthError, match="from this sender"):
        cache.check(b"a-more", 100.0, 100.0, "flooder")
    for i in range(16):  # another sender is untouched by the flood
        cache.check(b"b%d" % i, 100.0, 100.5, "honest")
    # the flooder's nonces expire with their dates, then it may send again
    cache.check(b"a-later", 131.5, 131.5, "flooder")
    assert len(cache) == 1  # every nonce dated 100.0 left with its window


def test_many_ports_of_one_address_fill_only_that_address_s_share() -> None:
    """A sender is an address and port; one machine has thousands of ports. Once 32 ports of
    one address filled a daemon's whole DHT cache, and it refused every datagram. Now an
    address holds a quarter of the cache, whatever its ports."""
    cache = ReplayCache(max_entries=64, per_sender=16, group_of=lambda s: s[0])
    refused = 0
    for port in range(32):
        for i in range(16):
            try:
                cache.check(b"%d-%d" % (port, i), 100.0, 100.0, ("10.0.0.66", port))
            except AuthError as exc:
                assert "from this address" in str(exc)
                refused += 1
    assert len(cache) == 16 and refused == 32 * 16 - 16
    for port in range(3):  # the other addresses fill the rest
        for i in range(16):
            cache.check(b"h%d-%d" % (port, i), 100.0, 100.0, (f"10.0.0.{port}", 7000))
    assert len(cache) == 64
    cache.check(b"late", 131.5, 131.5, ("10.0.0.66", 5))  # the flood's nonces left: room again
    assert len(cache) == 1


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.floats(-40, 6), st.floats(0, 3),
                          st.sampled_from(["a", "b", None])), max_size=120))
def test_the_cache_decides_as_a_plain_model_does(
        steps: list[tuple[int, float, float, str | None]]) -> None:
    """Against a dictionary swept whole at every message: the same refusals, the same size."""
    cache = ReplayCache(window=30.0, max_entries=24, per_sender=8)
    model: dict[int, tuple[float, str | None]] = {}  # nonce -> (forget after, sender)
    now = 1000.0
    for nonce, offset, advance, sender in steps:
        now += advance
        sent = now + offset
        model = {n: v for n, v in model.items() if v[0] >= int(now) + 1}
        if nonce in model:
            expect = "replayed"
        elif len(model) >= 24:
            expect = "too many messages within"
        elif sender is not None and sum(s == sender for _, s in model.values()) >= 8:
            expect = "from this sender"
        else:
            expect = ""
            model[nonce] = (max(int(sent + 30.0) + 1, int(now) + 1), sender)
        if expect:
            with pytest.raises(AuthError, match=expect):
                cache.check(b"%d" % nonce, sent, now, sender)
        else:
            cache.check(b"%d" % nonce, sent, now, sender)
        assert len(cache) == len(model)
