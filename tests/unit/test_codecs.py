"""Each wire codec's error on random data, with bounds that a broken codec would exceed."""

from __future__ import annotations

import numpy as np
import pytest

from moshpitd.allreduce.codecs import CODECS, CodecError, get_codec

# worst error per element: relative (half an ulp of the format) plus absolute (half the
# smallest subnormal step, where fp16 runs out of exponent)
BOUNDS = {"none": (0.0, 0.0), "fp16": (2 ** -11, 2 ** -25), "bf16": (2 ** -8, 0.0)}


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("n", [1, 255, 256, 257, 100_003])
def test_codec_error_on_random_data(name: str, n: int) -> None:
    codec = get_codec(name)
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 1e3], size=n)).astype(np.float32)
    wire = codec.encode(x)
    assert len(wire) == codec.encoded_size(n, np.dtype(np.float32))
    y = codec.decode(wire, n, np.dtype(np.float32))
    assert y.shape == (n,)
    err = np.abs(y.astype(np.float64) - x)
    if name == "int8":
        # blockwise: error at most half a step of the block's scale (max|x| / 127)
        blocks = -(-n // 256)
        padded = np.zeros(blocks * 256)
        padded[:n] = np.abs(x)
        step = np.repeat(padded.reshape(blocks, 256).max(1) / 127, 256)[:n]
        assert (err <= 0.5 * step * (1 + 1e-6) + 1e-12).all()
        print(f"int8: max error / step = {(err / np.maximum(step, 1e-30)).max():.3f}")
    else:
        rel, absolute = BOUNDS[name]
        assert (err <= rel * np.abs(x) + absolute + 1e-45).all(), err.max()
    if name != "none" and n >= 256:
        assert len(wire) < x.nbytes  # it does compress


def test_codecs_keep_float64_exact_only_without_compression() -> None:
    x = np.random.default_rng(0).standard_normal(1000)
    assert np.array_equal(get_codec("none").decode(get_codec("none").encode(x), 1000,
                                                   np.dtype(np.float64)), x)


def test_bad_payload_and_unknown_codec() -> None:
    with pytest.raises(CodecError):
        get_codec("zstd")
    with pytest.raises(CodecError):
        get_codec("fp16").decode(memoryview(b"\0" * 5), 3, np.dtype(np.float32))
