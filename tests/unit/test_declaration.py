"""Declaration: pack/unpack round trip; anything malformed unpacks to None."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moshpitd.matchmaking.declaration import Declaration

endpoints = st.text(max_size=256)
declarations = st.builds(Declaration, endpoints, st.binary(max_size=64), st.booleans())


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
        assert isinstance(out.client_mode, bool)
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


@pytest.mark.parametrize(
    "obj",
    [
        [1, "host:1", b"h"],  # too short
        [1, "host:1", b"h", False, 0],  # too long
        [2, "host:1", b"h", False],  # other version
        [0, "host:1", b"h", False],
        ["1", "host:1", b"h", False],
        [1, b"host:1", b"h", False],  # endpoint as bytes
        [1, 17, b"h", False],
        [1, None, b"h", False],
        [1, "x" * 257, b"h", False],  # endpoint too long
        [1, "host:1", "h", False],  # hash as str
        [1, "host:1", None, False],
        [1, "host:1", [1, 2], False],
        [1, "host:1", b"h", 0],  # client_mode as int
        [1, "host:1", b"h", "yes"],
        [1, "host:1", b"h", None],
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
    "raw", [b"", b"\xc1", b"\x94", b"\x94\x01", b"\xff" * 8, b"\x94\x01\xa3ab"]
)
def test_garbage_is_none(raw: bytes) -> None:
    assert Declaration.unpack(raw) is None


def test_endpoint_length_limit_is_inclusive() -> None:
    assert Declaration.unpack(Declaration("x" * 256, b"").pack()) == Declaration("x" * 256, b"")
    assert Declaration.unpack(Declaration("x" * 257, b"").pack()) is None

