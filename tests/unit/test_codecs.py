"""Each wire codec's error on random data, with bounds that a broken codec would exceed; parts
encoded from pieces; parts sized by their bytes on the wire."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from moshpitd.allreduce.codecs import CODECS, CodecError, get_codec
from moshpitd.allreduce.layout import DEFAULT_PART_BYTES, Run, plan_parts

# worst error per element: relative (half an ulp of the format) plus absolute (half the
# smallest subnormal step, where fp16 runs out of exponent)
BOUNDS = {"none": (0.0, 0.0), "fp16": (2 ** -11, 2 ** -25), "bf16": (2 ** -8, 0.0)}
BLOCKS = {"int8": (256, 127), "int4": (64, 7)}  # values per scale, levels each side of 0


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("n", [1, 2, 63, 64, 65, 255, 256, 257, 100_003])
def test_codec_error_on_random_data(name: str, n: int) -> None:
    codec = get_codec(name)
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 1e3], size=n)).astype(np.float32)
    wire = codec.encode(x)
    assert len(wire) == codec.encoded_size(n, np.dtype(np.float32))
    y = codec.decode(wire, n, np.dtype(np.float32))
    assert y.shape == (n,)
    err = np.abs(y.astype(np.float64) - x)
    if name in BLOCKS:
        # blockwise: error at most half a step of the block's scale (max|x| / levels)
        block, levels = BLOCKS[name]
        blocks = -(-n // block)
        padded = np.zeros(blocks * block)
        padded[:n] = np.abs(x)
        step = np.repeat(padded.reshape(blocks, block).max(1) / levels, block)[:n]
        assert (err <= 0.5 * step * (1 + 1e-6) + 1e-12).all()
        print(f"{name}: max error / step = {(err / np.maximum(step, 1e-30)).max():.3f}")
    else:
        rel, absolute = BOUNDS[name]
        assert (err <= rel * np.abs(x) + absolute + 1e-45).all(), err.max()
    if name != "none" and n >= 256:
        assert len(wire) < x.nbytes  # it does compress
    if name == "int4":
        assert len(wire) == 4 * -(-n // 64) + (n + 1) // 2  # 4.5 bits a value


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


def test_int4_error_bound_is_tight_enough_to_fail() -> None:
    """The bound above is met with little room: a codec with one level fewer (max|x| / 6)
    would break it on this data, so the test can tell 4 bits from 3.5."""
    x = np.random.default_rng(7).standard_normal(64 * 1000).astype(np.float32)
    codec = get_codec("int4")
    y = codec.decode(codec.encode(x), x.size, np.dtype(np.float32))
    step = np.repeat(np.abs(x).reshape(-1, 64).max(1) / 7, 64)
    ratio = (np.abs(y - x) / step).max()
    assert 0.45 < ratio <= 0.5 + 1e-6, ratio
    coarse = np.rint(x / (step * 7 / 6)) * (step * 7 / 6)
    assert (np.abs(coarse - x) / step).max() > 0.5


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_block_codecs_are_idempotent(name: str) -> None:
    """Values a block codec decoded encode to themselves: a trainer that quantizes its own
    contribution first (error feedback) knows exactly what the wire carries of it."""
    codec = get_codec(name)
    x = (np.random.default_rng(3).standard_normal(10_007) * 1e-3).astype(np.float32)
    once = codec.decode(codec.encode(x), x.size, np.dtype(np.float32))
    twice = codec.decode(codec.encode(once), x.size, np.dtype(np.float32))
    assert np.array_equal(once, twice)


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_block_codecs_spoil_only_the_block_of_a_bad_value(name: str, bad: float) -> None:
    """NaN or Inf in a block decodes to values that are not finite (so the receiver's check
    refuses the part, as it does for int8); the other blocks keep their values."""
    codec = get_codec(name)
    block = codec.block
    x = np.linspace(-1, 1, 5 * block + 3, dtype=np.float32)
    x[2 * block + 5] = bad
    with np.errstate(all="ignore"):
        y = codec.decode(codec.encode(x), x.size, np.dtype(np.float32))
    spoiled = ~np.isfinite(y)
    assert spoiled[2 * block:3 * block].all() and spoiled.sum() == block, spoiled.sum()
    good = np.isfinite(x)
    good[2 * block:3 * block] = False
    assert np.abs(y[good] - x[good]).max() <= 0.5 / (127 if name == "int8" else 7) + 1e-6


def test_int4_odd_sizes_round_trip_exactly_on_levels() -> None:
    """Values that are levels of their block's scale come back exactly, for odd sizes and a
    short last block; the padding nibble of an odd count is level 0."""
    codec = get_codec("int4")
    for n in (1, 3, 63, 65, 129, 1001):
        rng = np.random.default_rng(n)
        levels = rng.integers(-7, 8, size=n)
        levels[::64] = 7  # each block's max |x| is 7 scales
        scale = np.repeat(2.0 ** rng.integers(-20, 5, size=-(-n // 64)), 64)[:n]
        x = (levels * scale).astype(np.float32)
        wire = bytes(codec.encode(x))
        assert np.array_equal(codec.decode(memoryview(wire), n, np.dtype(np.float32)), x)
        if n % 2:
            assert wire[-1] >> 4 == 8


def test_block_codec_parts_start_on_block_boundaries() -> None:
    """Span bounds move to block boundaries of their run, parts hold whole blocks but the
    last of a run, and every value is still in exactly one part."""
    runs = [Run("float32", 1_000_003, (0,)), Run("float64", 777, (1,)),
            Run("float32", 65, (2,))]
    for name in ("int8", "int4"):
        codec = get_codec(name)
        for shares in ([1.0, 1.0, 1.0], [0.3, 1.0, 0.0, 0.7], [1.0]):
            parts = plan_parts(runs, shares, 1 << 16, codec)
            for r, run in enumerate(runs):
                mine = sorted((p.start, p.stop) for p in parts if p.run == r)
                assert mine[0][0] == 0 and mine[-1][1] == run.numel
                assert all(a[1] == b[0] for a, b in itertools.pairwise(mine))
                assert all(start % codec.block == 0 for start, _ in mine)
    # other codecs keep their span bounds where the shares put them
    assert any(p.start % 64 for p in plan_parts(runs, [1.0, 1.0, 1.0], 1 << 16,
                                                get_codec("fp16")))
