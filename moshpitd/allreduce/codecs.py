"""Wire codecs for parts: how a part's values are put on the wire and read back.

`none` sends the values as they lie in memory (zero copy); the others trade accuracy for bytes:
fp16 and bf16 halve float32, int8 quarters it with one float32 scale per block of 256 values,
int4 sends 4.5 bits a value: one float32 scale per block of 64 values, then the 64 values as
signed 4-bit levels -7..7 (scale = max |x| / 7), two to a byte.

The block codecs (int8, int4) are deterministic functions of the values: a trainer that runs
the same codec on its contribution knows exactly what the wire carried (error feedback,
client/error_feedback.py). Their parts start on block boundaries of their run (layout.py), so a
run encoded whole gives the same blocks as the round's parts. This module imports numpy only.

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
INT4_BLOCK = 64
INT4_LEVELS = 7  # |level| <= 7: 15 of the 16 nibble values (8 + level, so 1..15)
_SCALE = 4  # bytes of one block's float32 scale


class CodecError(ValueError):
    """A payload that does not decode to the expected number of values."""


@dataclass(frozen=True)
class Codec:
    name: str

    @property
    def block(self) -> int:
        """Values per scale (1: no blocks). Parts start on multiples of it within their run."""
        return {"int8": INT8_BLOCK, "int4": INT4_BLOCK}.get(self.name, 1)

    def encoded_size(self, n: int, dtype: np.dtype) -> int:
        if self.name == "none":
            return n * dtype.itemsize
        if self.name in ("fp16", "bf16"):
            return 2 * n
        if self.name == "int4":
            return _SCALE * -(-n // INT4_BLOCK) + (n + 1) // 2
        blocks = -(-n // INT8_BLOCK)
        return _SCALE * blocks + n

    def max_elements(self, nbytes: int, dtype: np.dtype) -> int:
        """The most values whose encoding fits in nbytes (at least 1): parts are sized by what
        they cost on the wire, whatever the codec."""
        if self.name == "none":
            return max(1, nbytes // dtype.itemsize)
        if self.name in ("fp16", "bf16"):
            return max(1, nbytes // 2)
        if self.name == "int4":  # a partial block: its scale, then two values a byte
            full, rest = divmod(nbytes, INT4_BLOCK // 2 + _SCALE)
            return max(1, full * INT4_BLOCK + 2 * max(rest - _SCALE, 0))
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
        if self.name == "int4":
            return [_int4(pieces, n).data.cast("B")]
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
        block = self.block
        blocks = -(-n // block)
        scales = np.frombuffer(payload[:_SCALE * blocks], dtype=np.float32)
        if self.name == "int4":
            q = _int4_levels(np.frombuffer(payload[_SCALE * blocks:], dtype=np.uint8), n)
        else:
            q = np.frombuffer(payload[_SCALE * blocks:], dtype=np.int8)
        out = np.empty(n, dtype=np.float32)
        full = n // block * block
        with np.errstate(all="ignore"):  # a liar's scale of Inf makes NaN: callers check
            # each level times its block's scale, cast inside the multiply: no float32 copy
            np.multiply(q[:full].reshape(-1, block), scales[:full // block, None],
                        out=out[:full].reshape(-1, block))
            if full < n:
                np.multiply(q[full:n], scales[-1:], out=out[full:])  # an array, not a scalar:
                # numpy 1.x would pick the float16 loop for a float32 scalar
        return out


    def decode_at(self, payload: memoryview | bytes, n: int, dtype: np.dtype,
                  offset: int) -> float:
        """The value at `offset` of a part's payload, decoded alone (its block's scale and
        levels for int8/int4): exactly what `decode` gives there, without decoding the part."""
        if self.block == 1:
            size = self.encoded_size(1, dtype)
            return float(self.decode(memoryview(payload)[offset * size:(offset + 1) * size], 1,
                                     dtype)[0])
        block = self.block
        b, blocks = offset // block, -(-n // block)
        count = min(block, n - b * block)
        scale = memoryview(payload)[_SCALE * b:_SCALE * (b + 1)]
        if self.name == "int4":
            start = _SCALE * blocks + b * block // 2
            levels = memoryview(payload)[start:start + (count + 1) // 2]
        else:
            start = _SCALE * blocks + b * block
            levels = memoryview(payload)[start:start + count]
        return float(self.decode(memoryview(bytes(scale) + bytes(levels)), count,
                                 dtype)[offset - b * block])


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


def _scaled(pieces: Sequence[np.ndarray], n: int, block: int, levels: int,
            scales: np.ndarray) -> np.ndarray:
    """The values gathered once into a padded float32 work array and divided in place by
    their block's scale (max |x| / levels, written into `scales`): levels, not yet rounded."""
    blocks = scales.size
    work = np.empty(blocks * block, dtype=np.float32)
    for pos, piece in _placed(pieces):
        work[pos:pos + piece.size] = piece
    work[n:] = 0
    shaped = work.reshape(blocks, block)
    # max |x| per block from max and min: no |x| temporary of the whole part
    np.maximum(shaped.max(axis=1), -shaped.min(axis=1), out=scales)
    scales /= levels
    safe = np.where(scales > 0, scales, np.float32(1.0))
    shaped /= safe[:, None]
    return work


def _int4(pieces: Sequence[np.ndarray], n: int) -> np.ndarray:
    """[float32 scale per block of 64][two levels a byte: value 2i in the low nibble of byte
    i, 2i+1 in its high nibble, each stored as 8 + level]. An odd count leaves the last high
    nibble 8 (level 0). A block with NaN or Inf gets a scale of NaN or Inf, so it decodes to
    values that are not finite, as with int8 (the receivers' checks refuse them)."""
    blocks = -(-n // INT4_BLOCK)
    out = np.empty(_SCALE * blocks + (n + 1) // 2, dtype=np.uint8)
    scales = out[:_SCALE * blocks].view(np.float32)
    work = _scaled(pieces, n, INT4_BLOCK, INT4_LEVELS, scales)
    work += 8.5  # 8 + level, rounded (half up) by the cast's truncation: one pass, not two
    with np.errstate(invalid="ignore"):  # NaN levels of a non-finite block: any nibble will do
        nibbles = work.astype(np.uint8)
    nibbles &= 15
    packed = out[_SCALE * blocks:]
    half = packed.size
    np.left_shift(nibbles[1:2 * half:2], 4, out=packed)
    packed |= nibbles[0:2 * half:2]
    return out


def _int4_levels(packed: np.ndarray, n: int) -> np.ndarray:
    """The signed levels -8..7 of n packed values (one int8 array, unpacked in place)."""
    levels = np.empty(2 * packed.size, dtype=np.uint8)
    np.bitwise_and(packed, 15, out=levels[0::2])
    np.right_shift(packed, 4, out=levels[1::2])
    signed = levels.view(np.int8)
    signed -= 8
    return signed[:n]


def _int8(pieces: Sequence[np.ndarray], n: int) -> np.ndarray:
    """[float32 scale per block][int8 values], built in one output buffer: the values are
    gathered once into a padded work array that is then scaled and rounded in place."""
    blocks = -(-n // INT8_BLOCK)
    out = np.empty(_SCALE * blocks + n, dtype=np.uint8)
    scales = out[:_SCALE * blocks].view(np.float32)
    work = _scaled(pieces, n, INT8_BLOCK, 127, scales)
    np.rint(work, out=work)
    out[_SCALE * blocks:].view(np.int8)[:] = work[:n]
    return out


CODECS = {name: Codec(name) for name in ("none", "fp16", "bf16", "int8", "int4")}


def get_codec(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise CodecError(f"unknown codec {name!r} (use one of {', '.join(CODECS)})") from None
