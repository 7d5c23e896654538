"""Wire codecs for parts: how a part's values are put on the wire and read back.

`none` sends the values as they lie in memory (zero copy); the others trade accuracy for bytes:
fp16 and bf16 halve float32, int8 quarters it with one float32 scale per block of 256 values.

A part may lie in several pieces of memory (it crosses tensors that are not adjacent): encoding
takes the pieces and writes each once into the wire buffer, never a gathered copy first. Decoding
yields values that numpy can add to an accumulator as they are (fp16 stays float16: the add
casts on the fly, with no float32 copy of the part).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

INT8_BLOCK = 256
_SCALE = 4  # bytes of one int8 block's float32 scale


class CodecError(ValueError):
    """A payload that does not decode to the expected number of values."""


@dataclass(frozen=True)
class Codec:
    name: str

    def encoded_size(self, n: int, dtype: np.dtype) -> int:
        if self.name == "none":
            return n * dtype.itemsize
        if self.name in ("fp16", "bf16"):
            return 2 * n
        blocks = -(-n // INT8_BLOCK)
        return _SCALE * blocks + n

    def max_elements(self, nbytes: int, dtype: np.dtype) -> int:
        """The most values whose encoding fits in nbytes (at least 1): parts are sized by what
        they cost on the wire, whatever the codec."""
        if self.name == "none":
            return max(1, nbytes // dtype.itemsize)
        if self.name in ("fp16", "bf16"):
            return max(1, nbytes // 2)
        full, rest = divmod(nbytes, INT8_BLOCK + _SCALE)
        return max(1, full * INT8_BLOCK + max(rest - _SCALE, 0))

    def encode(self, values: np.ndarray) -> memoryview:
        """Wire bytes of a 1-D array (a view of it for `none`)."""
        if self.name == "none":
            return np.ascontiguousarray(values).data.cast("B")
        return self.encode_pieces([values])[0]

    def encode_pieces(self, pieces: Sequence[np.ndarray]) -> list[memoryview]:
        """Wire bytes of the pieces' concatenation, as payloads to send one after another:
        the pieces themselves for `none`, else one buffer each piece is encoded into."""
        if self.name == "none":
            return [np.ascontiguousarray(p).data.cast("B") for p in pieces]
        n = sum(p.size for p in pieces)
        if self.name == "fp16":
            out16 = np.empty(n, dtype=np.float16)
            for pos, piece in _placed(pieces):
                out16[pos:pos + piece.size] = piece  # the cast writes straight into place
            return [out16.data.cast("B")]
        if self.name == "bf16":
            bits = np.empty(n, dtype=np.uint16)
            for pos, piece in _placed(pieces):
                _bf16_into(piece, bits[pos:pos + piece.size])
            return [bits.data.cast("B")]
        return [_int8(pieces, n).data.cast("B")]

    def decode(self, payload: memoryview, n: int, dtype: np.dtype) -> np.ndarray:
        """Values of a part: a view of the payload for `none` and fp16, else one new array."""
        if len(payload) != self.encoded_size(n, dtype):
            raise CodecError(f"{self.name} payload of {len(payload)} bytes for {n} values")
        if self.name == "none":
            return np.frombuffer(payload, dtype=dtype)
        if self.name == "fp16":
            return np.frombuffer(payload, dtype=np.float16)
        if self.name == "bf16":
            raw = np.frombuffer(payload, dtype=np.uint16)
            return np.left_shift(raw, 16, dtype=np.uint32).view(np.float32)
        blocks = -(-n // INT8_BLOCK)
        scales = np.frombuffer(payload[:_SCALE * blocks], dtype=np.float32)
        q = np.frombuffer(payload[_SCALE * blocks:], dtype=np.int8)
        out = np.empty(n, dtype=np.float32)
        full = n // INT8_BLOCK * INT8_BLOCK
        with np.errstate(all="ignore"):  # a liar's scale of Inf makes NaN: callers check
            # int8 times its block's scale, cast inside the multiply: no float32 copy of q
            np.multiply(q[:full].reshape(-1, INT8_BLOCK), scales[:full // INT8_BLOCK, None],
                        out=out[:full].reshape(-1, INT8_BLOCK))
            if full < n:
                np.multiply(q[full:], scales[-1:], out=out[full:])  # an array, not a scalar:
                # numpy 1.x would pick the float16 loop for a float32 scalar
        return out


def _placed(pieces: Sequence[np.ndarray]) -> list[tuple[int, np.ndarray]]:
    out, pos = [], 0
    for p in pieces:
        out.append((pos, p))
        pos += p.size
    return out


def _bf16_into(values: np.ndarray, out: np.ndarray) -> None:
    """float32 -> bfloat16 bits, rounding to nearest even on the 16 bits dropped."""
    as32 = values.astype(np.float32, copy=False).view(np.uint32)
    rounded = as32 >> 16
    rounded &= 1
    rounded += 0x7FFF
    rounded += as32
    rounded >>= 16
    out[:] = rounded


def _int8(pieces: Sequence[np.ndarray], n: int) -> np.ndarray:
    """[float32 scale per block][int8 values], built in one output buffer: the values are
    gathered once into a padded work array that is then scaled and rounded in place."""
    blocks = -(-n // INT8_BLOCK)
    out = np.empty(_SCALE * blocks + n, dtype=np.uint8)
    scales = out[:_SCALE * blocks].view(np.float32)
    work = np.empty(blocks * INT8_BLOCK, dtype=np.float32)
    for pos, piece in _placed(pieces):
        work[pos:pos + piece.size] = piece
    work[n:] = 0
    shaped = work.reshape(blocks, INT8_BLOCK)
    # max |x| per block from max and min: no |x| temporary of the whole part
    np.maximum(shaped.max(axis=1), -shaped.min(axis=1), out=scales)
    scales /= 127.0
    safe = np.where(scales > 0, scales, np.float32(1.0))
    shaped /= safe[:, None]
    np.rint(work, out=work)
    out[_SCALE * blocks:].view(np.int8)[:] = work[:n]
    return out


CODECS = {name: Codec(name) for name in ("none", "fp16", "bf16", "int8")}


def get_codec(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise CodecError(f"unknown codec {name!r} (use one of {', '.join(CODECS)})") from None
