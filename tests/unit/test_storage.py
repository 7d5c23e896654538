"""SubkeyStorage: version merge, TTL deadlines on an injected clock, expiry and caps."""

from __future__ import annotations

import gc
import math
import os
import time
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kademlia.storage import IStorage

from moshpitd.dht.records import Proof
from moshpitd.dht.storage import KEY_COST, MAX_TTL, RECORD_COST, SubkeyStorage

KEY = b"k" * 20


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(clock: FakeClock) -> SubkeyStorage:
    return SubkeyStorage(clock=clock)


def test_store_then_get_reports_value_version_and_remaining_ttl(
    store: SubkeyStorage, clock: FakeClock
) -> None:
    assert store.store_sub(KEY, b"peer", b"decl", 7, 30.0)
    assert store.get_subs(KEY) == {b"peer": (b"decl", 7, 30.0)}
    clock.advance(12.5)
    assert store.get_subs(KEY) == {b"peer": (b"decl", 7, 17.5)}
    assert store.sub_keys() == [KEY]


def test_unknown_key_has_no_subs(store: SubkeyStorage) -> None:
    assert store.get_subs(b"nothing") == {}
    assert store.sub_keys() == []


def test_higher_version_wins_even_if_it_arrives_first(store: SubkeyStorage) -> None:
    assert store.store_sub(KEY, b"p", b"new", 2, 30.0)
    assert not store.store_sub(KEY, b"p", b"old", 1, 60.0)  # longer ttl does not help
    assert store.get_subs(KEY)[b"p"][:2] == (b"new", 2)


def test_higher_version_replaces_lower(store: SubkeyStorage) -> None:
    assert store.store_sub(KEY, b"p", b"old", 1, 60.0)
    assert store.store_sub(KEY, b"p", b"new", 2, 5.0)  # even with a shorter ttl
    assert store.get_subs(KEY)[b"p"] == (b"new", 2, 5.0)


def test_equal_version_later_deadline_wins(store: SubkeyStorage, clock: FakeClock) -> None:
    assert store.store_sub(KEY, b"p", b"a", 3, 10.0)
    assert not store.store_sub(KEY, b"p", b"b", 3, 5.0)  # earlier deadline: refused
    assert not store.store_sub(KEY, b"p", b"c", 3, 10.0)  # identical deadline: refused
    assert store.get_subs(KEY)[b"p"][0] == b"a"
    assert store.store_sub(KEY, b"p", b"d", 3, 20.0)
    assert store.get_subs(KEY)[b"p"] == (b"d", 3, 20.0)
    # the same ttl re-sent later lands at a later deadline: a refresh
    clock.advance(1.0)
    assert store.store_sub(KEY, b"p", b"e", 3, 20.0)
    assert store.get_subs(KEY)[b"p"] == (b"e", 3, 20.0)


def test_tombstone_is_stored_and_beats_late_older_declaration(store: SubkeyStorage) -> None:
    assert store.store_sub(KEY, b"p", b"decl", 1, 30.0)
    assert store.store_sub(KEY, b"p", b"", 2, 30.0)
    assert store.get_subs(KEY) == {b"p": (b"", 2, 30.0)}
    assert not store.store_sub(KEY, b"p", b"decl", 1, 30.0)
    assert store.get_subs(KEY)[b"p"][0] == b""


def test_tombstone_first_then_older_declaration_is_refused(store: SubkeyStorage) -> None:
    assert store.store_sub(KEY, b"p", b"", 5, 30.0)
    assert not store.store_sub(KEY, b"p", b"decl", 4, 30.0)
    assert store.get_subs(KEY) == {b"p": (b"", 5, 30.0)}


def test_record_expires_at_its_deadline(store: SubkeyStorage, clock: FakeClock) -> None:
    assert store.store_sub(KEY, b"p", b"v", 1, 10.0)
    clock.advance(9.5)
    assert b"p" in store.get_subs(KEY)
    clock.advance(0.5)
    assert store.get_subs(KEY) == {}
    assert store.sub_keys() == []


def test_expiry_is_per_subkey(store: SubkeyStorage, clock: FakeClock) -> None:
    assert store.store_sub(KEY, b"short", b"v", 1, 5.0)
    assert store.store_sub(KEY, b"long", b"v", 1, 50.0)
    clock.advance(6.0)
    assert set(store.get_subs(KEY)) == {b"long"}


def test_expired_record_does_not_block_lower_version(
    store: SubkeyStorage, clock: FakeClock
) -> None:
    assert store.store_sub(KEY, b"p", b"v9", 9, 1.0)
    clock.advance(2.0)
    assert store.store_sub(KEY, b"p", b"v1", 1, 10.0)
    assert store.get_subs(KEY)[b"p"] == (b"v1", 1, 10.0)


@pytest.mark.parametrize("ttl", [MAX_TTL + 1, 1e9, math.inf])
def test_ttl_is_capped(store: SubkeyStorage, clock: FakeClock, ttl: float) -> None:
    assert store.store_sub(KEY, b"p", b"v", 1, ttl)
    assert store.get_subs(KEY)[b"p"][2] == MAX_TTL
    clock.advance(MAX_TTL - 1)
    assert b"p" in store.get_subs(KEY)
    clock.advance(1)
    assert store.get_subs(KEY) == {}


@pytest.mark.parametrize("ttl", [-1.0, -1e-9, -math.inf, math.nan])
def test_negative_or_nan_ttl_refused(store: SubkeyStorage, ttl: float) -> None:
    assert not store.store_sub(KEY, b"p", b"v", 1, ttl)
    assert store.get_subs(KEY) == {}
    assert store.sub_keys() == []


def test_zero_ttl_record_is_never_visible(store: SubkeyStorage) -> None:
    store.store_sub(KEY, b"p", b"v", 1, 0.0)
    assert store.get_subs(KEY) == {}


def test_oversized_value_refused(clock: FakeClock) -> None:
    s = SubkeyStorage(max_value_bytes=16, clock=clock)
    assert s.store_sub(KEY, b"p", b"x" * 16, 1, 10.0)
    assert not s.store_sub(KEY, b"q", b"x" * 17, 1, 10.0)
    assert not s.store_sub(KEY, b"p", b"x" * 17, 2, 10.0)  # not even as an update
    assert s.get_subs(KEY) == {b"p": (b"x" * 16, 1, 10.0)}


def test_oversized_value_does_not_create_key(clock: FakeClock) -> None:
    s = SubkeyStorage(max_value_bytes=4, clock=clock)
    assert not s.store_sub(KEY, b"p", b"12345", 1, 10.0)
    assert s.sub_keys() == []


def test_long_subkey_refused(store: SubkeyStorage) -> None:
    assert store.store_sub(KEY, b"s" * 64, b"v", 1, 10.0)
    assert not store.store_sub(KEY, b"s" * 65, b"v", 1, 10.0)
    assert set(store.get_subs(KEY)) == {b"s" * 64}


def test_a_full_key_takes_a_new_writer_in_place_of_the_longest_stored(
        clock: FakeClock) -> None:
    """Throw-away identities that fill a key hold it only while they keep writing: an honest
    writer (who writes every round) gets in at once, in place of the record stored longest
    ago; the cap holds."""
    s = SubkeyStorage(max_subkeys=3, clock=clock)
    for i in range(3):
        assert s.store_sub(KEY, bytes([i]), b"v", 1, 10.0 + i)
    assert s.store_sub(KEY, b"\x00", b"v2", 2, 10.0)  # an update: now the most recent
    assert s.get_subs(KEY)[b"\x00"][:2] == (b"v2", 2)
    assert s.store_sub(KEY, b"\x09", b"v", 1, 100.0)
    assert set(s.get_subs(KEY)) == {b"\x00", b"\x02", b"\x09"} and s.evicted == 1
    for i in range(20, 26):  # a flood of new writers: the key never holds more than 3
        assert s.store_sub(KEY, bytes([i]), b"v", 1, 600.0)
    assert len(s.get_subs(KEY)) == 3 and s.records == 3
    assert s.store_sub(KEY, b"\x42", b"honest", 5, 10.0)  # and the next honest write is in
    assert b"\x42" in s.get_subs(KEY)


def test_proven_writers_keep_their_places_in_a_key_flooded_by_unproven_ones(
        clock: FakeClock) -> None:
    """Writers that answered our probe (`protected`) are displaced only by each other: a flood
    of throw-away identities churns through the other places, and once every place is a
    proven writer's, an unproven newcomer is refused (before its signature is checked)."""
    proven = {b"h1", b"h2"}
    s = SubkeyStorage(max_subkeys=3, clock=clock, protected=proven.__contains__)
    assert s.store_sub(KEY, b"h1", b"v", 1, 10.0)
    assert s.store_sub(KEY, b"x0", b"v", 1, 10.0)
    assert s.store_sub(KEY, b"h2", b"v", 1, 10.0)
    for i in range(1, 50):  # the flood: each new identity takes the last unproven place
        assert s.store_sub(KEY, b"x%d" % i, b"v", 1, 600.0)
        assert set(s.get_subs(KEY)) == {b"h1", b"h2", b"x%d" % i}
    proven.add(b"h3")  # a proven newcomer displaces the unproven record
    assert s.store_sub(KEY, b"h3", b"v", 1, 10.0)
    assert set(s.get_subs(KEY)) == {b"h1", b"h2", b"h3"}
    assert not s.admissible(KEY, b"x99", b"v", 1, 10.0) and s.refused_full == 1
    assert not s.store_sub(KEY, b"x99", b"v", 1, 10.0) and s.refused_full == 2
    proven.add(b"h4")  # all proven: the one stored longest ago goes
    assert s.store_sub(KEY, b"h4", b"v", 1, 10.0)
    assert set(s.get_subs(KEY)) == {b"h2", b"h3", b"h4"}
    clock.advance(11.0)  # expired records make room for anyone
    assert s.admissible(KEY, b"x99", b"v", 1, 10.0)
    assert s.store_sub(KEY, b"x99", b"v", 1, 10.0)


def test_subkey_cap_is_per_key(clock: FakeClock) -> None:
    s = SubkeyStorage(max_subkeys=1, clock=clock)
    assert s.store_sub(b"a" * 20, b"p", b"v", 1, 10.0)
    assert s.store_sub(b"b" * 20, b"p", b"v", 1, 10.0)
    assert s.store_sub(b"a" * 20, b"q", b"v", 1, 10.0)
    assert set(s.get_subs(b"a" * 20)) == {b"q"} and set(s.get_subs(b"b" * 20)) == {b"p"}


def test_when_full_expired_keys_go_first_then_the_least_recently_used(clock: FakeClock) -> None:
    """A full store takes a new key: a flood of new keys cannot lock out the next round's."""
    s = SubkeyStorage(max_keys=2, clock=clock)
    assert s.store_sub(b"a", b"p", b"v", 1, 5.0)
    assert s.store_sub(b"b", b"p", b"v", 1, 50.0)
    assert s.store_sub(b"a", b"q", b"v", 1, 5.0)  # existing key still takes subkeys
    clock.advance(6.0)  # key a expires entirely; nothing has read it since
    assert s.store_sub(b"c", b"p", b"v", 1, 50.0)
    assert sorted(s.sub_keys()) == [b"b", b"c"]
    assert s.evicted == 0  # only expired records went
    s.get_subs(b"b")  # read: b is now more recently used than c
    assert s.store_sub(b"d", b"p", b"v", 1, 50.0)
    assert sorted(s.sub_keys()) == [b"b", b"d"] and s.evicted == 1
    s.signed(b"b", touch=False)  # handing records over is not a use
    assert s.store_sub(b"e", b"p", b"v", 1, 50.0)
    assert sorted(s.sub_keys()) == [b"d", b"e"] and s.evicted == 2


def test_memory_is_bounded_by_bytes(clock: FakeClock) -> None:
    cost = KEY_COST + RECORD_COST + 20 + 1000
    s = SubkeyStorage(max_bytes=10 * cost, max_value_bytes=1000, clock=clock)
    for i in range(100):
        assert s.store_sub(i.to_bytes(20, "big"), bytes(20), b"x" * 1000, 1, 60.0)
        assert s.bytes_used <= s.max_bytes
    assert s.bytes_used == 10 * cost and s.records == 10 and s.evicted == 90
    assert sorted(s.sub_keys()) == [i.to_bytes(20, "big") for i in range(90, 100)]
    # small records after large ones: the freed bytes are reused
    for i in range(30):
        assert s.store_sub(b"small" + bytes([i]), bytes(20), b"y", 1, 60.0)
    assert s.bytes_used <= s.max_bytes
    # replacing a record charges the difference, and dropping everything gives it all back
    assert s.store_sub(b"small\x00", bytes(20), b"z" * 500, 2, 60.0)
    assert s.bytes_used <= s.max_bytes
    clock.advance(61.0)
    s.store_sub(b"last", b"w" * 20, b"", 1, 1.0)
    assert s.records == 1 and s.bytes_used == KEY_COST + RECORD_COST + 20


def test_one_record_larger_than_the_whole_store_is_refused(clock: FakeClock) -> None:
    s = SubkeyStorage(max_bytes=RECORD_COST + KEY_COST + 100, clock=clock)
    assert not s.store_sub(KEY, b"p", b"x" * 200, 1, 10.0)
    assert s.sub_keys() == [] and s.bytes_used == 0 and s.refused_full == 1


def test_records_per_writer_are_capped(clock: FakeClock) -> None:
    s = SubkeyStorage(max_per_writer=3, clock=clock)
    for i in range(3):
        assert s.store_sub(bytes([i]) * 20, b"w", b"v", 1, 10.0)
    assert not s.store_sub(b"\x09" * 20, b"w", b"v", 1, 10.0)
    assert s.store_sub(b"\x09" * 20, b"other", b"v", 1, 10.0)  # another writer: room
    assert s.store_sub(b"\x00" * 20, b"w", b"v2", 2, 10.0)  # an update is no new record
    clock.advance(10.5)  # once the writer's records expire it may write again
    assert s.store_sub(b"\x09" * 20, b"w", b"v", 1, 10.0)


def test_charged_bytes_cover_the_memory_records_really_take() -> None:
    """RECORD_COST and KEY_COST are what Python holds per record and key beyond the bytes of
    value and subkey: the bound by bytes is a bound on memory (within a tenth)."""
    raw = [os.urandom(20 + 20 + 300 + 32 + 64) for _ in range(3000)]
    for per_key in (1, 30):
        s = SubkeyStorage(max_keys=1 << 20, max_bytes=1 << 40, max_per_writer=1 << 20,
                          max_subkeys=1 << 20, clock=FakeClock())
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        key = b""
        for i, r in enumerate(raw):  # fresh objects, as decoded from datagrams
            if i % per_key == 0:
                key = bytes(bytearray(r[:20]))
            proof = Proof(60.0, r[340:372], r[372:])
            s.store_sub(key, r[20:40], r[40:340], time.time_ns(), 60.0, proof)
        real = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert real <= s.bytes_used * 1.1, (per_key, real, s.bytes_used)
        assert s.bytes_used <= real * 1.5, (per_key, real, s.bytes_used)


# --- merge order independence -----------------------------------------------------------------

_write = st.tuples(
    st.sampled_from([b"p0", b"p1", b"p2"]),  # subkey
    st.binary(max_size=8),  # value (b"" = tombstone)
    st.integers(min_value=0, max_value=6),  # version
    st.integers(min_value=1, max_value=60),  # ttl, whole seconds: distinct ttls stay distinct
)


@settings(max_examples=150, deadline=None)
@given(
    writes=st.lists(_write, max_size=12, unique_by=lambda w: (w[0], w[2], w[3])),
    data=st.data(),
)
def test_merge_is_order_independent(
    writes: list[tuple[bytes, bytes, int, int]], data: st.DataObject
) -> None:
    """At one instant, any arrival order of the same writes leaves the same records: per subkey
    the highest (version, deadline). (Writes that tie on both are excluded: the writer never
    stamps two different values with one version.)"""
    order = data.draw(st.permutations(writes))
    states = []
    for seq in (writes, order, list(reversed(writes))):
        s = SubkeyStorage(clock=FakeClock())
        for sk, value, version, ttl in seq:
            s.store_sub(KEY, sk, value, version, float(ttl))
        states.append(s.get_subs(KEY))
    assert states[0] == states[1] == states[2]
    expected = {}
    for sk, value, version, ttl in writes:
        if sk not in expected or (version, ttl) > expected[sk][1:]:
            expected[sk] = (value, version, float(ttl))
    assert states[0] == expected


@settings(max_examples=100, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("store"), _write),
            st.tuples(st.just("advance"), st.floats(min_value=0, max_value=30)),
        ),
        max_size=25,
    )
)
def test_only_live_records_are_returned(ops: list[tuple[str, object]]) -> None:
    """Whatever happens, every record returned has 0 < remaining ttl <= its written ttl, and a
    record that was just accepted is visible with the value, version and ttl it was written with."""
    clock = FakeClock()
    s = SubkeyStorage(clock=clock)
    for kind, arg in ops:
        if kind == "advance":
            clock.advance(arg)  # type: ignore[arg-type]
        else:
            sk, value, version, ttl = arg  # type: ignore[misc]
            accepted = s.store_sub(KEY, sk, value, version, float(ttl))
            if accepted:
                got_value, got_version, remaining = s.get_subs(KEY)[sk]
                assert (got_value, got_version) == (value, version)
                assert remaining == pytest.approx(ttl)
        for _, _, remaining in s.get_subs(KEY).values():
            assert 0 < remaining <= 60 + 1e-9


# --- kademlia IStorage plain values ------------------------------------------------------------


def test_plain_istorage_methods(clock: FakeClock) -> None:
    s = SubkeyStorage(clock=clock)
    assert isinstance(s, IStorage)
    s[b"a"] = b"1"
    clock.advance(10)
    s[b"b"] = 2
    assert s[b"a"] == b"1"
    assert s.get(b"b") == 2
    assert s.get(b"missing") is None
    assert s.get(b"missing", "dflt") == "dflt"
    with pytest.raises(KeyError):
        s[b"missing"]
    assert sorted(s, key=lambda kv: kv[0]) == [(b"a", b"1"), (b"b", 2)]
    assert s.iter_older_than(5) == [(b"a", b"1")]
    clock.advance(10)
    assert sorted(s.iter_older_than(5), key=lambda kv: kv[0]) == [(b"a", b"1"), (b"b", 2)]
    assert s.iter_older_than(100) == []


def test_plain_values_are_bounded(clock: FakeClock) -> None:
    s = SubkeyStorage(max_keys=2, clock=clock)
    s[b"a"] = 1
    s[b"b"] = 2
    s[b"c"] = 3  # silently dropped
    assert s.get(b"c") is None
    s[b"a"] = 10  # existing keys may still be overwritten
    assert s[b"a"] == 10
    assert len(list(s)) == 2


def test_plain_and_subkey_records_are_separate(store: SubkeyStorage) -> None:
    store[KEY] = b"plain"
    assert store.get_subs(KEY) == {}
    assert store.store_sub(KEY, b"p", b"sub", 1, 10.0)
    assert store[KEY] == b"plain"
