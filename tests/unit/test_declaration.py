"""Declaration: pack/unpack round trip; anything malformed unpacks to None."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moshpitd.matchmaking.declaration import Declaration

endpoints = st.text(max_size=256)
amounts = st.floats(min_value=0, allow_infinity=False)
declarations = st.builds(Declaration, endpoints, st.binary(max_size=64), st.booleans(),
                         endpoints, amounts, amounts, st.booleans())


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


GOOD = [2, "host:1", b"h", False, "host:2", 1.0, 1.0, False]


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
        GOOD[:7],  # too short
        [*GOOD, 0],  # too long
        _with(0, 1),  # other format
        _with(0, "2"),
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

