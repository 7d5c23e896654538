"""SubkeyProtocol handlers without a network: argument validation, storage, replies (who
enters the routing table, and what a newcomer is handed: test_dht_welcome.py)."""

from __future__ import annotations

import asyncio
import time

import pytest
import umsgpack
from hypothesis import given, settings
from hypothesis import strategies as st
from kademlia.node import Node

from moshpitd.dht.records import CLOCK_SKEW, sign
from moshpitd.identity import PeerKey
from tests.unit.dht_fakes import (
    ADDR,
    KEY,
    PEER_ID,
    SELF_ID,
    WRITER_A,
    WRITER_B,
    A,
    B,
    FakeClock,
    signed,
)
from tests.unit.dht_fakes import in_loop as _in_loop
from tests.unit.dht_fakes import pings as _pings
from tests.unit.dht_fakes import proto as _proto
from tests.unit.dht_fakes import request as _request

NOW = time.time_ns()  # record versions are writers' wall clocks in ns: set again per test


@pytest.fixture(autouse=True)
def _versions_from_now() -> None:
    """Versions must lie within the clock window when a test runs, not when it was collected."""
    global NOW
    NOW = time.time_ns()


# --- direct handler calls ---------------------------------------------------------------------


def test_store_sub_then_find_subs() -> None:
    proto = _proto()
    a = signed(WRITER_A, b"decl", NOW + 3, 30.0)
    b = signed(WRITER_B, b"", NOW + 1, 10)  # int ttl
    assert proto.rpc_store_sub(ADDR, PEER_ID, *a) is True
    assert proto.rpc_store_sub(ADDR, PEER_ID, *b) is True
    got = proto.rpc_find_subs(ADDR, PEER_ID, KEY)
    # records go out as they came in: value, version, remaining ttl and the writer's proof
    assert sorted(got["subs"]) == sorted([[A, b"decl", NOW + 3, 30.0, a[5]],
                                          [B, b"", NOW + 1, 10.0, [10.0, *b[5][1:]]]])
    assert proto.rpc_find_subs(ADDR, PEER_ID, b"\x09" * 20) == {"subs": []}


def test_find_subs_answers_what_one_datagram_holds_proven_writers_first() -> None:
    """A key holds 256 records of up to 1 KiB: more than a reply datagram, which was then not
    sent at all (the asker saw nothing of the key). Now the reply takes proven writers'
    records first, then our DHT contacts', then the latest stored, up to what fits."""
    from moshpitd.auth import OVERHEAD
    from moshpitd.dht.protocol import MAX_DATAGRAM

    proto = _proto()
    writers = [PeerKey.generate() for _ in range(120)]
    proven = {writers[3].peer_id, writers[70].peer_id}
    proto.storage.protected = proven.__contains__
    for w in writers:
        assert proto.rpc_store_sub(ADDR, PEER_ID, *signed(w, b"v" * 900, NOW, 30.0))
    contact = writers[5].peer_id  # a daemon we talk to, stored long ago
    proto.router.add_contact(Node(contact, "10.0.0.5", 4000))
    proto.answered.add(contact, ("10.0.0.5", 4000))  # (one that only sent requests: none)
    rows = proto.rpc_find_subs(ADDR, PEER_ID, KEY)["subs"]
    reply = b"\x01" + b"\x00" * 20 + umsgpack.packb({"subs": rows})
    assert len(reply) <= MAX_DATAGRAM - OVERHEAD
    assert 40 < len(rows) < len(writers)
    assert {r[0] for r in rows[:2]} == proven and rows[2][0] == contact
    latest = [w.peer_id for w in reversed(writers) if w.peer_id not in proven | {contact}]
    assert [r[0] for r in rows[3:]] == latest[:len(rows) - 3]


def test_store_sub_merges_by_version() -> None:
    proto = _proto()
    new = signed(WRITER_A, b"new", NOW + 5, 30.0)
    assert proto.rpc_store_sub(ADDR, PEER_ID, *new) is True
    assert proto.rpc_store_sub(ADDR, PEER_ID, *signed(WRITER_A, b"old", NOW + 4, 30.0)) is False
    assert proto.rpc_find_subs(ADDR, PEER_ID, KEY)["subs"] == [[A, b"new", NOW + 5, 30.0,
                                                                new[5]]]
    assert proto.verifier.refused == {}  # an older record is not a forgery


def test_store_sub_refusals_are_false_not_errors() -> None:
    proto = _proto()
    assert proto.rpc_store_sub(ADDR, PEER_ID, *signed(WRITER_A, b"v", NOW, -1.0)) is False
    assert proto.rpc_store_sub(ADDR, PEER_ID, *signed(WRITER_A, b"x" * 5000, NOW, 1.0)) is False
    key, _, value, version, ttl, proof = signed(WRITER_A, b"v", NOW, 1.0)
    assert proto.rpc_store_sub(ADDR, PEER_ID, key, b"s" * 65, value, version, ttl,
                               proof) is False
    assert proto.rpc_find_subs(ADDR, PEER_ID, KEY) == {"subs": []}


def test_only_the_subkeys_own_signature_is_accepted() -> None:
    """A record under peer A's id must carry A's key and A's signature over exactly what it
    says (key, subkey, value, version, signed ttl), dated within the clock window."""
    proto = _proto()
    key, sk, value, version, ttl, proof = signed(WRITER_A, b"decl", NOW, 30.0)
    other = sign(WRITER_B, KEY, b"decl", NOW, 30.0).wire()
    forged = [
        (sk, value, version, ttl, None),  # unsigned
        (sk, value, version, ttl, [30.0, proof[1]]),  # malformed proof
        (sk, value, version, ttl, [30.0, proof[1][:31], proof[2]]),
        (sk, value, version, ttl, other),  # B's valid signature, A's subkey
        (sk, value, version, ttl, [30.0, proof[1], other[2]]),  # A's key, B's signature
        (sk, b"", version, ttl, proof),  # a tombstone under A's signature of its declaration
        (sk, value, version + 1, ttl, proof),  # another version
        (sk, value, version, ttl, [60.0, proof[1], proof[2]]),  # a longer signed life
        (b"\x05" * 20, value, version, ttl, proof),  # A's record moved to another subkey
    ]
    for record in forged:
        assert proto.rpc_store_sub(ADDR, PEER_ID, key, *record) is False, record
    assert proto.rpc_store_sub(ADDR, PEER_ID, b"\x04" * 20, sk, value, version, ttl,
                               proof) is False  # under another key
    skew = int(CLOCK_SKEW * 1e9)
    future = signed(WRITER_A, b"decl", time.time_ns() + skew + 10**10, 30.0)
    stale = signed(WRITER_A, b"decl", time.time_ns() - skew - 31 * 10**9, 30.0)
    assert proto.rpc_store_sub(ADDR, PEER_ID, *future) is False
    assert proto.rpc_store_sub(ADDR, PEER_ID, *stale) is False
    assert proto.storage.sub_keys() == []
    assert proto.verifier.refused == {"unsigned": 3, "wrong_signer": 2, "bad_signature": 5,
                                      "version": 2}
    # the genuine record goes in, and is checked once however often it comes back
    assert proto.rpc_store_sub(ADDR, PEER_ID, key, sk, value, version, ttl, proof) is True
    checks = proto.verifier.verifications
    proto.storage._subs.clear()
    assert proto.rpc_store_sub(ADDR, PEER_ID, key, sk, value, version, ttl, proof) is True
    assert proto.verifier.verifications == checks


def test_a_record_lives_no_longer_than_it_was_signed_for() -> None:
    """A replica may say more time is left than the writer signed: it gets what the
    signature allows by our clock, within the clock skew."""
    proto = _proto()
    version = time.time_ns() - 20 * 10**9  # written 20 s ago, to live 25 s
    key, sk, value, _, _, proof = signed(WRITER_A, b"decl", version, 25.0)
    assert proto.rpc_store_sub(ADDR, PEER_ID, key, sk, value, version, 25.0, proof) is True
    (_, _, _, ttl, _), = proto.rpc_find_subs(ADDR, PEER_ID, KEY)["subs"]
    assert ttl <= 25.0 - 20.0 + CLOCK_SKEW


_GOOD_STORE = (PEER_ID, *signed(WRITER_A, b"value", NOW, 10.0))


@pytest.mark.parametrize(
    ("position", "bad"),
    [
        (0, b"\x02" * 19), (0, b"\x02" * 21), (0, "x" * 20), (0, None), (0, 7),
        (1, b"\x03" * 19), (1, b""), (1, "k" * 20), (1, [1]),
        (2, "sk"), (2, None), (2, 1),
        (3, "value"), (3, None), (3, [b"v"]),
        (4, 1.0), (4, "1"), (4, None),
        (5, "10"), (5, None), (5, True), (5, b"\x0a"),
    ],
)
def test_store_sub_malformed_raises_value_error(position: int, bad: object) -> None:
    proto = _proto()
    args = list(_GOOD_STORE)
    args[position] = bad
    with pytest.raises(ValueError):
        proto.rpc_store_sub(ADDR, *args)  # type: ignore[arg-type]
    assert proto.storage.sub_keys() == []
    assert proto.router.is_new_node(Node(PEER_ID))  # a bad request does not earn a contact


@pytest.mark.parametrize(
    ("nodeid", "key"),
    [(b"\x02" * 19, KEY), (PEER_ID, b"\x03" * 21), ("a" * 20, KEY), (PEER_ID, None),
     (None, None), (PEER_ID, 3)],
)
def test_find_subs_malformed_raises_value_error(nodeid: object, key: object) -> None:
    with pytest.raises(ValueError):
        _proto().rpc_find_subs(ADDR, nodeid, key)  # type: ignore[arg-type]


def test_stock_rpcs_validate_arguments() -> None:
    proto = _proto()
    with pytest.raises(ValueError):
        proto.rpc_ping(ADDR, b"short")
    with pytest.raises(ValueError):
        proto.rpc_store(ADDR, PEER_ID, KEY, [1, 2])
    with pytest.raises(ValueError):
        proto.rpc_store(ADDR, PEER_ID, b"k", b"v")
    with pytest.raises(ValueError):
        proto.rpc_find_node(ADDR, PEER_ID, "k" * 20)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        proto.rpc_find_value(ADDR, None, KEY)  # type: ignore[arg-type]


def test_stock_rpcs_work_with_good_arguments() -> None:
    proto = _proto()
    assert proto.rpc_ping(ADDR, PEER_ID) == SELF_ID
    assert proto.rpc_store(ADDR, PEER_ID, KEY, b"plain") is True
    assert proto.storage.get(KEY) == b"plain"
    assert proto.rpc_find_value(ADDR, PEER_ID, KEY) == {"value": b"plain"}
    other = b"\x05" * 20
    proto.welcome(Node(other, "10.0.0.5", 5))  # (a contact that answered us)
    # unknown value: falls back to neighbours, excluding the asker
    assert proto.rpc_find_value(ADDR, PEER_ID, b"\x09" * 20) == [(other, "10.0.0.5", 5)]
    assert proto.rpc_find_node(ADDR, PEER_ID, KEY) == [(other, "10.0.0.5", 5)]


# --- datagrams through _safe_solve --------------------------------------------------------------


def test_datagram_store_sub_gets_a_reply() -> None:
    async def body() -> None:
        proto = _proto(transport=True)
        msg_id = b"\x11" * 20
        record = signed(WRITER_A, b"decl", NOW + 2, 15.0)
        proto.datagram_received(_request("store_sub", PEER_ID, *record, msg_id=msg_id), ADDR)
        for _ in range(5):
            await asyncio.sleep(0)
        sent = proto.transport.sent  # type: ignore[union-attr]
        assert sent[0] == (b"\x01" + msg_id + umsgpack.packb(True), ADDR)
        assert [a for _, a in _pings(proto)] == [ADDR]  # and the sender is probed
        assert proto.storage.get_subs(KEY) == {A: (b"decl", NOW + 2, 15.0)}
        assert proto.malformed == 0

        await proto._safe_solve(_request("find_subs", PEER_ID, KEY, msg_id=msg_id), ADDR)
        data, addr = sent[-1]
        assert addr == ADDR and data[:21] == b"\x01" + msg_id
        assert umsgpack.unpackb(data[21:]) == {"subs": [[A, b"decl", NOW + 2, 15.0,
                                                         record[5]]]}

    _in_loop(body)


@pytest.mark.parametrize(
    "datagram",
    [
        b"",
        b"\x00" * 21,  # too short for a body
        b"\x03" + b"\x07" * 20 + umsgpack.packb(["ping", [PEER_ID]]),  # unknown kind
        b"\x00" + b"\x07" * 20 + b"\xc1",  # undecodable
        b"\x00" + b"\x07" * 20 + umsgpack.packb({"ping": [PEER_ID]}),  # not a list
        b"\x00" + b"\x07" * 20 + umsgpack.packb(["ping"]),  # wrong length
        b"\x00" + b"\x07" * 20 + umsgpack.packb([1, [PEER_ID]]),  # name not str
        _request("no_such_rpc", PEER_ID),
        b"\x00" + b"\x07" * 20 + umsgpack.packb(["ping", PEER_ID]),  # args not a list
        _request("ping"),  # missing argument
        _request("ping", PEER_ID, PEER_ID),  # extra argument
        _request("ping", b"short"),
        _request("store_sub", PEER_ID, KEY, "p", b"v", 1, 1.0, []),
        _request("store_sub", PEER_ID, KEY, b"p", b"v", 1, "1", []),
        _request("store_sub", PEER_ID, KEY, b"p", b"v", 1, 1.0),  # no proof at all
        _request("find_subs", PEER_ID, b"k"),
        _request("store", PEER_ID, KEY, {"a": 1}),
        _request("find_node", PEER_ID, None),
        _request("find_value", 1, KEY),
    ],
)
def test_malformed_datagrams_are_counted_and_unanswered(datagram: bytes) -> None:
    async def body() -> None:
        proto = _proto(transport=True)
        await proto._safe_solve(datagram, ADDR)
        assert proto.malformed == 1
        assert proto.transport.sent == []  # type: ignore[union-attr]
        assert proto.storage.sub_keys() == []

    _in_loop(body)


def test_unsolicited_response_is_ignored() -> None:
    async def body() -> None:
        proto = _proto(transport=True)
        await proto._safe_solve(b"\x01" + b"\x07" * 20 + umsgpack.packb(True), ADDR)
        assert proto.transport.sent == []  # type: ignore[union-attr]

    _in_loop(body)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False) | st.text(max_size=10)
    | st.binary(max_size=22) | st.sampled_from([PEER_ID, KEY, b"\x00" * 20]),
    lambda children: st.lists(children, max_size=4),
    max_leaves=8,
)
rpc_names = st.sampled_from(
    ["store_sub", "find_subs", "ping", "store", "find_node", "find_value", "stun", "nope",
     "_safe_solve", "__init__"]
)


@settings(max_examples=200, deadline=None)
@given(name=rpc_names, args=st.lists(msgpack_values, max_size=7), kind=st.sampled_from(b"\x00\x01"))
def test_fuzzed_requests_never_raise(name: str, args: list[object], kind: int) -> None:
    datagram = bytes([kind]) + b"\x07" * 20 + umsgpack.packb([name, args])

    async def body() -> None:
        proto = _proto(transport=True)
        await proto._safe_solve(datagram, ADDR)
        sent = proto.transport.sent  # type: ignore[union-attr]
        replies = [d for d, a in sent if a == ADDR and d[:1] == b"\x01"]
        if kind == 0:
            # a request is either answered once or counted as malformed
            assert (len(replies), proto.malformed) in ((1, 0), (0, 1))
        else:
            assert sent == [] and proto.malformed == 0

    _in_loop(body)


@settings(max_examples=200, deadline=None)
@given(datagram=st.binary(max_size=80))
def test_arbitrary_datagrams_never_raise(datagram: bytes) -> None:
    async def body() -> None:
        proto = _proto(transport=True)
        await proto._safe_solve(datagram, ADDR)
        assert proto.malformed in (0, 1)

    _in_loop(body)


def test_one_address_brings_new_writers_at_a_bounded_rate() -> None:
    """A member storing records of throw-away identities from one address (3,500 a second once
    kept every daemon's loop a fifth busy checking their signatures): past NEW_WRITERS_BURST
    new writers, a store from that address is refused before its signature is checked, until
    the rate allows; writers held here, proven writers and other addresses are not held back."""
    from moshpitd.dht.protocol import NEW_WRITERS, NEW_WRITERS_BURST, NEW_WRITERS_RATE

    proto = _proto()
    clock = proto.storage.clock
    assert isinstance(clock, FakeClock)
    held, proven = PeerKey.generate(), PeerKey.generate()
    proto.storage.protected = {proven.peer_id}.__contains__
    assert proto.rpc_store_sub(ADDR, PEER_ID, *signed(held, b"v", NOW, 30.0))
    flooded = b"\x05" * 20  # (a key holds 256 records: the flood's own key keeps `held`'s)
    for _ in range(NEW_WRITERS_BURST - 1):
        assert proto.rpc_store_sub(ADDR, PEER_ID, *signed(PeerKey.generate(), b"v", NOW, 30.0,
                                                          key=flooded))
    checked = proto.verifier.verifications
    assert not proto.rpc_store_sub(ADDR, PEER_ID, *signed(PeerKey.generate(), b"v", NOW, 30.0,
                                                          key=flooded))
    assert proto.verifier.refused[NEW_WRITERS] == 1
    assert proto.verifier.verifications == checked  # refused before its signature
    # a writer already held, a proven one, and another address's new writer still pass
    assert proto.rpc_store_sub(ADDR, PEER_ID, *signed(held, b"w", NOW + 1, 30.0))
    assert proto.rpc_store_sub(ADDR, PEER_ID, *signed(proven, b"v", NOW, 30.0))
    assert proto.rpc_store_sub(("10.0.0.3", 4000), PEER_ID,
                               *signed(PeerKey.generate(), b"v", NOW, 30.0))
    # the rate refills the address's bucket
    clock.now += 1.0 / NEW_WRITERS_RATE
    assert proto.rpc_store_sub(ADDR, PEER_ID, *signed(PeerKey.generate(), b"v", NOW, 30.0))
