"""Declaration: pack/unpack round trip; anything malformed unpacks to None."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moshpitd.matchmaking.declaration import (
    MAX_RANK_DIGESTS,
    RANK_DIGEST,
    Declaration,
    first_differing_rank,
    rank_digests,
)
from moshpitd.matchmaking.errors import SchemaMismatch

endpoints = st.text(max_size=256)
amounts = st.floats(min_value=0, allow_infinity=False)
digests = st.integers(0, MAX_RANK_DIGESTS).flatmap(
    lambda n: st.binary(min_size=n * RANK_DIGEST, max_size=n * RANK_DIGEST))
declarations = st.builds(Declaration, endpoints, st.binary(max_size=64), st.booleans(),
                         endpoints, amounts, amounts, st.booleans(), digests)


@settings(max_examples=200, deadline=None)
@given(decl=declarations)
def test_pack_unpack_round_trip(decl: Declaration) -> None:
    raw = decl.pack()
    assert isinstance(raw, bytes)
    assert Declaration.unpack(raw) == decl


def test_default_client_mode_round_trips() -> None:
    decl = Declaration("10.0.0.1:5000", b"\x01" * 16)
    out = Declaration.unpack(decl.pack())
    assert out == decl
    assert out is not None and out.client_mode is False


def _check_unpacked(raw: bytes) -> None:
    out = Declaration.unpack(raw)
    if out is not None:
        assert isinstance(out.endpoint, str) and len(out.endpoint) <= 256
        assert isinstance(out.schema_hash, bytes)
        assert isinstance(out.client_mode, bool) and isinstance(out.withdrawn, bool)
        assert out.weight >= 0 and out.bandwidth >= 0  # finite, or the comparison fails
        assert out.weight < float("inf") and out.bandwidth < float("inf")
        assert Declaration.unpack(out.pack()) == out


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=300))
def test_arbitrary_bytes_never_raise(raw: bytes) -> None:
    _check_unpacked(raw)


msgpack_objects = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False) | st.text(max_size=300) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(obj=msgpack_objects)
def test_arbitrary_msgpack_values_never_raise(obj: object) -> None:
    _check_unpacked(msgpack.packb(obj))


@settings(max_examples=200, deadline=None)
@given(decl=declarations, cut=st.integers(min_value=0))
def test_truncated_declaration_is_none(decl: Declaration, cut: int) -> None:
    raw = decl.pack()
    assert Declaration.unpack(raw[: cut % len(raw)]) is None


@settings(max_examples=100, deadline=None)
@given(decl=declarations, extra=st.binary(min_size=1, max_size=8))
def test_trailing_bytes_make_it_none(decl: Declaration, extra: bytes) -> None:
    assert Declaration.unpack(decl.pack() + extra) is None


GOOD = [3, "host:1", b"h", False, "host:2", 1.0, 1.0, False, b""]


def _with(index: int, value: object) -> list[object]:
    out = list(GOOD)
    out[index] = value
    return out


def test_the_good_shape_unpacks() -> None:
    assert Declaration.unpack(msgpack.packb(GOOD)) == Declaration("host:1", b"h", False,
                                                                   "host:2", 1.0, 1.0)


@pytest.mark.parametrize(
    "obj",
    [
        GOOD[:4],  # the format-1 shape
        [1, "host:1", b"h", False],
        [2, *GOOD[1:8]],  # the format-2 shape
        GOOD[:8],  # too short
        [*GOOD, 0],  # too long
        _with(0, 1),  # other format
        _with(0, 2),
        _with(0, "3"),
        _with(0, True),
        _with(1, b"host:1"),  # endpoint as bytes
        _with(1, 17),
        _with(1, None),
        _with(1, "x" * 257),  # endpoint too long
        _with(2, "h"),  # hash as str
        _with(2, None),
        _with(2, [1, 2]),
        _with(3, 0),  # client_mode as int
        _with(3, "yes"),
        _with(4, None),  # data endpoint
        _with(4, "x" * 257),
        _with(5, -1.0),  # weight
        _with(5, float("nan")),
        _with(5, float("inf")),
        _with(5, True),
        _with(5, "1"),
        _with(6, -0.5),  # bandwidth
        _with(6, float("inf")),
        _with(7, 1),  # withdrawn as int
        _with(8, b"abc"),  # rank digests: not whole digests
        _with(8, b"\0" * RANK_DIGEST * (MAX_RANK_DIGESTS + 1)),  # too many
        _with(8, None),
        _with(8, [b"abcd"]),
        {"endpoint": "host:1"},
        "host:1",
        1,
        None,
        [],
    ],
)
def test_wrong_shapes_are_none(obj: object) -> None:
    assert Declaration.unpack(msgpack.packb(obj)) is None


@pytest.mark.parametrize(
    "raw", [b"", b"\xc1", b"\x98", b"\x98\x02", b"\xff" * 8, b"\x98\x02\xa3ab"]
)
def test_garbage_is_none(raw: bytes) -> None:
    assert Declaration.unpack(raw) is None


def test_withdrawn_keeps_the_entry() -> None:
    decl = Declaration("h:1", b"s", True, "h:2", 3.0, 2.0)
    out = Declaration.unpack(decl.withdraw().pack())
    assert out is not None and out.withdrawn and out == Declaration("h:1", b"s", True, "h:2",
                                                                    3.0, 2.0, True)


def test_endpoint_length_limit_is_inclusive() -> None:
    assert Declaration.unpack(Declaration("x" * 256, b"").pack()) == Declaration("x" * 256, b"")
    assert Declaration.unpack(Declaration("x" * 257, b"").pack()) is None



def test_the_declaration_of_a_big_shard_host_fits_a_dht_value() -> None:
    """dht_max_value_bytes is 1 KiB by default: endpoints of ordinary length and the most rank
    digests a declaration names still fit."""
    ranks = rank_digests([[("float32", [i, 3])] for i in range(MAX_RANK_DIGESTS)])
    assert len(ranks) == MAX_RANK_DIGESTS * RANK_DIGEST
    decl = Declaration("[2001:db8::1]:40000", b"\1" * 32, False, "[2001:db8::1]:40001", 1.0,
                       1.0, False, ranks)
    assert len(decl.pack()) <= 1024
    assert rank_digests([[("float32", [1])]] * (MAX_RANK_DIGESTS + 1)) == b""  # names none


def test_the_first_differing_rank_is_named() -> None:
    a = [[("float32", [4, 2])], [("float16", [7])], [("float32", [3])]]
    b = [[("float32", [4, 2])], [("float16", [8])], [("float32", [3])]]
    ours, theirs = rank_digests(a), rank_digests(b)
    assert first_differing_rank(ours, theirs) == 1
    assert first_differing_rank(ours, ours) is None
    assert first_differing_rank(ours, b"") is None and first_differing_rank(b"", ours) is None
    assert first_differing_rank(ours, rank_digests(a[:2])) == 2  # the peer has no rank 2
    assert first_differing_rank(rank_digests(a[:2]), ours) is None  # we have no rank 2
    # the same tensors split otherwise are other ranks' digests
    assert first_differing_rank(rank_digests([a[0] + a[1], a[2]]), ours) == 0


def test_schema_mismatch_names_the_smallest_rank_and_carries_it() -> None:
    a = [[("float32", [4])], [("float32", [5])], [("float32", [6])]]
    ours = rank_digests(a)
    peers = {b"\x01" * 20: rank_digests([a[0], a[1], [("float32", [9])]]),
             b"\x02" * 20: rank_digests([a[0], [("float64", [5])], a[2]]),
             b"\x03" * 20: b""}
    err = SchemaMismatch("they differ", ours, peers)
    assert err.rank == 1 and err.extra == {"rank": 1}
    assert str(err).startswith("local rank 1 of this host holds other tensors than local rank "
                               "1 of peer 02020202")
    assert str(err).endswith(": they differ")
    plain = SchemaMismatch("they differ", b"", peers)
    assert plain.rank is None and plain.extra == {} and str(plain) == "they differ"


def test_declarations_read_again_are_parsed_once_and_the_memory_of_them_is_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from moshpitd.matchmaking import declaration as module

    monkeypatch.setattr(module, "UNPACKED_ENTRIES", 8)
    monkeypatch.setattr(module, "_UNPACKED", module.OrderedDict())
    raws = [Declaration(f"h:{i}", b"s" * 32).pack() for i in range(20)] + [b"junk"]
    first = [Declaration.unpack(r) for r in raws]
    assert [Declaration.unpack(r) for r in raws] == first  # the same answers from memory
    assert first[-1] is None and first[3] == Declaration("h:3", b"s" * 32)
    assert len(module._UNPACKED) == 8
