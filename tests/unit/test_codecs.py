"""Each wire codec's error on random data, with bounds that a broken codec would exceed; parts
encoded from pieces; parts sized by their bytes on the wire."""

from __future__ import annotations

import numpy as np
import pytest

from moshpitd.allreduce.codecs import CODECS, CodecError, get_codec
from moshpitd.allreduce.layout import DEFAULT_PART_BYTES, Run, plan_parts

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


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_pieces_encode_like_their_concatenation(name: str, dtype: type) -> None:
    codec, x = get_codec(name), np.random.default_rng(1).standard_normal(1000).astype(dtype)
    whole = bytes(codec.encode(x))
    for cuts in ([], [1], [255, 256, 700], [0, 999]):
        pieces = np.split(x, cuts)
        assert b"".join(bytes(p) for p in codec.encode_pieces(pieces)) == whole
    if name == "none":  # the pieces themselves, no copy
        assert np.shares_memory(np.frombuffer(codec.encode_pieces([x[3:9]])[0], dtype), x)


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_max_elements_is_the_most_that_fit(name: str, dtype: type) -> None:
    codec, dt = get_codec(name), np.dtype(dtype)
    for nbytes in [*range(1, 700), 1 << 19, (1 << 20) - 1, 1 << 20]:
        n = codec.max_elements(nbytes, dt)
        assert n >= 1
        if codec.encoded_size(1, dt) <= nbytes:
            assert codec.encoded_size(n, dt) <= nbytes < codec.encoded_size(n + 1, dt)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_default_parts_are_half_to_one_mib_on_the_wire(name: str) -> None:
    """Parts are sized by encoded bytes: int8 parts hold ~4x the values of `none` parts."""
    codec, f32 = get_codec(name), np.dtype(np.float32)
    runs = [Run("float32", 10_000_000, (0,))]
    parts = plan_parts(runs, [1.0, 2.0, 1.0], DEFAULT_PART_BYTES, codec)
    wire = [codec.encoded_size(p.numel, f32) for p in parts]
    assert max(wire) <= 1 << 20
    last_of_span = {max(i for i, p in enumerate(parts) if p.owner == o) for o in range(3)}
    assert all(w >= 1 << 19 for i, w in enumerate(wire) if i not in last_of_span)
    assert max(wire) > (1 << 20) - 260  # not merely under the cap: as full as it fits
    assert sum(p.numel for p in parts) == 10_000_000
