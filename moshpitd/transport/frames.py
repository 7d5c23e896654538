"""Reduce-stream frames: u32 header length, PartHeader protobuf, raw payload.

The payload never passes through protobuf, so a part's bytes are copied once into the frame and
read back without a copy (numpy views over the received bytes).
"""

from __future__ import annotations

import struct

from moshpitd.proto import moshpit_pb2 as pb

_LEN = struct.Struct(">I")
MAX_HEADER = 4096


class FrameError(ValueError):
    """A frame that cannot be decoded."""


def encode(header: pb.PartHeader, payload: bytes | memoryview = b"") -> bytes:
    head = header.SerializeToString()
    return b"".join((_LEN.pack(len(head)), head, payload))


def decode(frame: bytes) -> tuple[pb.PartHeader, memoryview]:
    if not isinstance(frame, bytes) or len(frame) < _LEN.size:
        raise FrameError("frame shorter than its length prefix")
    (hlen,) = _LEN.unpack_from(frame)
    if hlen > MAX_HEADER or _LEN.size + hlen > len(frame):
        raise FrameError(f"frame header length {hlen} does not fit a {len(frame)}-byte frame")
    header = pb.PartHeader()
    try:
        header.ParseFromString(frame[_LEN.size:_LEN.size + hlen])
    except Exception as exc:  # protobuf's DecodeError and friends
        raise FrameError(f"undecodable part header: {exc}") from exc
    return header, memoryview(frame)[_LEN.size + hlen:]
