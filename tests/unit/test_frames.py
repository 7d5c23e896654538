"""Reduce-stream frames: u32 header length | PartHeader | raw payload."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moshpitd.proto import moshpit_pb2 as pb
from moshpitd.transport.frames import MAX_HEADER, FrameError, decode, encode

headers = st.builds(
    pb.PartHeader,
    group_id=st.binary(max_size=32),
    sender=st.integers(min_value=0, max_value=2**32 - 1),
    part=st.integers(min_value=0, max_value=2**32 - 1),
    codec=st.just(pb.NONE),
    status=st.sampled_from([pb.OK, pb.ABORT]),
    message=st.text(max_size=200),
)


@settings(max_examples=300, deadline=None)
@given(header=headers, payload=st.binary(max_size=2048))
def test_round_trip(header: pb.PartHeader, payload: bytes) -> None:
    frame = encode(header, payload)
    assert isinstance(frame, bytes)
    got, body = decode(frame)
    assert got == header
    assert isinstance(body, memoryview)
    assert bytes(body) == payload


def test_payload_is_a_view_of_the_frame() -> None:
    frame = encode(pb.PartHeader(part=3), b"abcdef")
    _, body = decode(frame)
    assert body.obj is frame
    assert body.nbytes == 6


def test_memoryview_payload_is_encoded() -> None:
    data = bytearray(b"0123456789")
    frame = encode(pb.PartHeader(sender=1), memoryview(data)[2:5])
    assert bytes(decode(frame)[1]) == b"234"


def test_layout_of_a_frame() -> None:
    header = pb.PartHeader(group_id=b"g", part=7)
    frame = encode(header, b"PAY")
    head = header.SerializeToString()
    assert frame == struct.pack(">I", len(head)) + head + b"PAY"


def test_empty_header_and_payload() -> None:
    header, body = decode(b"\x00\x00\x00\x00")
    assert header == pb.PartHeader()
    assert bytes(body) == b""


@pytest.mark.parametrize("frame", [b"", b"\x00", b"\x00\x00", b"\x00\x00\x00"])
def test_short_frames_rejected(frame: bytes) -> None:
    with pytest.raises(FrameError):
        decode(frame)


@pytest.mark.parametrize("frame", [bytearray(b"\x00\x00\x00\x00"), "abcd", None, 1234])
def test_non_bytes_rejected(frame: object) -> None:
    with pytest.raises(FrameError):
        decode(frame)  # type: ignore[arg-type]


def test_header_length_over_limit_rejected() -> None:
    frame = struct.pack(">I", MAX_HEADER + 1) + b"\x00" * (MAX_HEADER + 100)
    with pytest.raises(FrameError):
        decode(frame)
    with pytest.raises(FrameError):
        decode(b"\xff\xff\xff\xff" + b"\x00" * 64)


def test_header_at_limit_accepted() -> None:
    # tag (1 byte) + two-byte length varint + the text
    header = pb.PartHeader(message="x" * (MAX_HEADER - 3))
    assert len(header.SerializeToString()) == MAX_HEADER
    got, body = decode(encode(header, b"p"))
    assert got == header
    assert bytes(body) == b"p"


def test_encoded_header_over_limit_does_not_decode() -> None:
    """encode does not enforce the limit; the receiving side refuses such a frame."""
    frame = encode(pb.PartHeader(message="x" * (MAX_HEADER + 10)))
    with pytest.raises(FrameError):
        decode(frame)


@pytest.mark.parametrize("extra", [0, 1, 100])
def test_header_length_past_end_rejected(extra: int) -> None:
    head = pb.PartHeader(group_id=b"abc", sender=2).SerializeToString()
    frame = struct.pack(">I", len(head) + 1 + extra) + head
    with pytest.raises(FrameError):
        decode(frame)


@pytest.mark.parametrize(
    "head",
    [
        b"\xff\xff\xff",  # truncated varint key
        b"\x0a\x05ab",  # group_id claims 5 bytes, has 2
        b"\x32\x02\xff\xfe",  # message: invalid UTF-8
        b"\x10",  # sender tag without a value
        b"\x07",  # field 0 / invalid wire type
    ],
)
def test_garbage_header_rejected(head: bytes) -> None:
    with pytest.raises(FrameError):
        decode(struct.pack(">I", len(head)) + head + b"payload")


@settings(max_examples=400, deadline=None)
@given(frame=st.binary(max_size=64))
def test_arbitrary_bytes_only_raise_frame_error(frame: bytes) -> None:
    try:
        header, body = decode(frame)
    except FrameError:
        return
    (hlen,) = struct.unpack_from(">I", frame)
    assert isinstance(header, pb.PartHeader)
    assert len(body) == len(frame) - 4 - hlen


@settings(max_examples=400, deadline=None)
@given(head=st.binary(max_size=48), payload=st.binary(max_size=16))
def test_arbitrary_headers_only_raise_frame_error(head: bytes, payload: bytes) -> None:
    """A well-formed length prefix in front of random header bytes."""
    try:
        header, body = decode(struct.pack(">I", len(head)) + head + payload)
    except FrameError:
        return
    assert isinstance(header, pb.PartHeader)
    assert bytes(body) == payload


def test_frame_error_is_value_error() -> None:
    assert issubclass(FrameError, ValueError)
