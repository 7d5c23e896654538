"""Just enough HTTP/2 to open gRPC calls by hand (RFC 9113 frames, RFC 7541 literal header
fields): a client that never reads what the server sends, which no gRPC library can be."""

from __future__ import annotations

import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, SETTINGS, PING = 0x0, 0x1, 0x4, 0x6
END_STREAM, END_HEADERS = 0x1, 0x4
INITIAL_WINDOW_SIZE = 0x4


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, stream) + payload


def _integer(value: int, prefix_bits: int = 7) -> bytes:
    top = (1 << prefix_bits) - 1
    if value < top:
        return bytes([value])
    out, value = bytearray([top]), value - top
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    out.append(value)
    return bytes(out)


def header_block(fields: list[tuple[str, str]]) -> bytes:
    """Every field a literal without indexing, new name, no Huffman coding."""
    out = bytearray()
    for name, value in fields:
        out.append(0x00)
        for text in (name.encode(), value.encode()):
            out += _integer(len(text)) + text
    return bytes(out)


def settings(**values: int) -> bytes:
    ids = {"initial_window_size": INITIAL_WINDOW_SIZE}
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", ids[k], v)
                                          for k, v in values.items()))


def grpc_call(stream: int, authority: str, path: str, message: bytes, claimed: int,
              end: bool = False) -> bytes:
    """HEADERS opening a gRPC call on `stream`, then one DATA frame: a message whose length
    prefix says `claimed` bytes, of which `message` is the start."""
    headers = header_block([(":method", "POST"), (":scheme", "http"), (":path", path),
                            (":authority", authority), ("content-type", "application/grpc"),
                            ("te", "trailers")])
    body = struct.pack(">BI", 0, claimed) + message
    return (frame(HEADERS, END_HEADERS, stream, headers)
            + frame(DATA, END_STREAM if end else 0, stream, body))


def ping(opaque: bytes = b"\0" * 8) -> bytes:
    return frame(PING, 0, 0, opaque)
