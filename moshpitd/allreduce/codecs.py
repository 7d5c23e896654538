"""Wire codecs for parts: how a part's values are put on the wire and read back.

`none` sends the values as they lie in memory (zero copy); the others trade accuracy for bytes:
fp16 and bf16 halve float32, int8 quarters it with one float32 scale per block of 256 values.
Decoding always yields float32 or float64 values ready to accumulate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

INT8_BLOCK = 256


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
        return 4 * blocks + n

    def encode(self, values: np.ndarray) -> memoryview:
        """Wire bytes of a 1-D array (a view of it for `none`)."""
        if self.name == "none":
            return np.ascontiguousarray(values).data.cast("B")
        if self.name == "fp16":
            return values.astype(np.float16).data.cast("B")
        if self.name == "bf16":
            as32 = values.astype(np.float32, copy=False).view(np.uint32)
            # round to nearest even on the 16 bits we drop
            rounded = (as32 + 0x7FFF + ((as32 >> 16) & 1)) >> 16
            return rounded.astype(np.uint16).data.cast("B")
        n = values.size
        blocks = -(-n // INT8_BLOCK)
        padded = np.zeros(blocks * INT8_BLOCK, dtype=np.float32)
        padded[:n] = values
        shaped = padded.reshape(blocks, INT8_BLOCK)
        scales = np.abs(shaped).max(axis=1) / 127.0
        safe = np.where(scales > 0, scales, 1.0).astype(np.float32)
        q = np.rint(shaped / safe[:, None]).astype(np.int8).reshape(-1)[:n]
        return memoryview(scales.astype(np.float32).tobytes() + q.tobytes())

    def decode(self, payload: memoryview, n: int, dtype: np.dtype) -> np.ndarray:
        """Values of a part; a view of the payload for `none`."""
        if len(payload) != self.encoded_size(n, dtype):
            raise CodecError(f"{self.name} payload of {len(payload)} bytes for {n} values")
        if self.name == "none":
            return np.frombuffer(payload, dtype=dtype)
        if self.name == "fp16":
            return np.frombuffer(payload, dtype=np.float16).astype(np.float32)
        if self.name == "bf16":
            raw = np.frombuffer(payload, dtype=np.uint16).astype(np.uint32) << 16
            return raw.view(np.float32)
        blocks = -(-n // INT8_BLOCK)
        scales = np.frombuffer(payload[:4 * blocks], dtype=np.float32)
        q = np.frombuffer(payload[4 * blocks:], dtype=np.int8).astype(np.float32)
        return q * np.repeat(scales, INT8_BLOCK)[:n]


CODECS = {name: Codec(name) for name in ("none", "fp16", "bf16", "int8")}


def get_codec(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise CodecError(f"unknown codec {name!r} (use one of {', '.join(CODECS)})") from None
