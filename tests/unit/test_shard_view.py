"""ShardView (moshpitd/local/shards.py): the ranks' tensors, each in its own buffer, read and
written part by part as the one flat vector a FlatView over their concatenation would be."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moshpitd.allreduce.codecs import CODECS
from moshpitd.allreduce.layout import FlatView, LayoutError, TensorSpec, plan_parts
from moshpitd.ipc.schema import aligned
from moshpitd.local.shards import ShardView
from moshpitd.matchmaking.declaration import RANK_DIGEST, first_differing_rank

DTYPES = ["float16", "float32", "float64"]
tensor_st = st.tuples(st.sampled_from(DTYPES), st.integers(0, 300))


def buffer_with(tensors: list[tuple[str, int]], seed: int) -> tuple[FlatView, list[np.ndarray]]:
    """One rank's buffer holding its tensors at aligned offsets, filled with distinct values."""
    specs, offset = [], 0
    for dtype, n in tensors:
        offset = aligned(offset)
        specs.append(TensorSpec(dtype, (n,), offset))
        offset += n * np.dtype(dtype).itemsize
    memory = bytearray(max(offset, 1))
    arrays = [np.frombuffer(memory, s.dtype, s.numel, s.offset) for s in specs]
    rng = np.random.default_rng(seed)
    for a in arrays:
        a[:] = rng.integers(-1000, 1000, a.size)
    return FlatView(memoryview(memory), specs), arrays


@settings(max_examples=60, deadline=None)
@given(ranks=st.lists(st.lists(tensor_st, min_size=1, max_size=4), min_size=1, max_size=4),
       members=st.integers(1, 4), part_bytes=st.sampled_from([64, 256, 4096]))
def test_parts_read_and_write_the_ranks_buffers(ranks: list[list[tuple[str, int]]],
                                                members: int, part_bytes: int) -> None:
    shards = [buffer_with(tensors, seed) for seed, tensors in enumerate(ranks)]
    view = ShardView([v for v, _ in shards])
    flat = [a for _, arrays in shards for a in arrays]  # the concatenation, tensor by tensor
    assert [s.dtype for s in view.specs] == [a.dtype.name for a in flat]
    parts = plan_parts(view.runs, [1.0] * members, part_bytes, CODECS["none"])
    # every run's values, read part by part, are the concatenation's, in order
    for r, run in enumerate(view.runs):
        want = np.concatenate([flat[i] for i in run.tensors])
        got = np.concatenate([view.read(p) for p in parts if p.run == r])
        np.testing.assert_array_equal(got, want)
    # a part written lands in the ranks' own buffers: no copy holds the vector
    for p in parts:
        view.write(p, np.full(p.numel, p.index % 50, dtype=view.runs[p.run].dtype))
    for r, run in enumerate(view.runs):
        got = np.concatenate([flat[i] for i in run.tensors])
        want = np.concatenate([np.full(p.numel, p.index % 50) for p in parts if p.run == r])
        np.testing.assert_array_equal(got, want)


def test_a_part_across_two_ranks_is_two_pieces() -> None:
    view = ShardView([buffer_with([("float32", 10)], 0)[0], buffer_with([("float32", 6)], 1)[0]])
    (part,) = plan_parts(view.runs, [1.0], 1 << 20, CODECS["none"])
    assert [p.size for p in view.views(part)] == [10, 6]


def test_bad_values_name_the_rank_and_its_tensor() -> None:
    a, _ = buffer_with([("float32", 4)], 0)
    b, arrays = buffer_with([("float64", 3), ("float32", 5)], 1)
    arrays[1][2] = np.nan
    view = ShardView([a, b])
    with pytest.raises(LayoutError, match=r"^local rank 1: tensor 1 contains NaN"):
        view.check_finite()
    parts = plan_parts(view.runs, [1.0], 1 << 20, CODECS["none"])
    bad = next(p for p in parts if p.run == 2)
    with pytest.raises(LayoutError, match=r"^local rank 1: tensor 1 contains NaN"):
        view.check_part(bad)


def test_spans_are_cut_to_each_rank() -> None:
    view = ShardView([buffer_with([("float32", 4)], 0)[0],
                      buffer_with([("float32", 3), ("float16", 2)], 1)[0]])
    spans = [(0, 5, 3), (5, 9, 1)]
    assert view.rank_spans(spans, 0) == ((0, 4, 3),)
    assert view.rank_spans(spans, 1) == ((0, 1, 3), (1, 5, 1))


def test_rank_digests_tell_which_rank_differs() -> None:
    """What a shard host declares: hosts that split alike differ at the rank that differs,
    whatever their values."""
    host = [[("float32", 10), ("float16", 3)], [("float64", 4)], [("float32", 7)]]
    other = [list(r) for r in host]
    other[1] = [("float64", 5)]
    digests = [ShardView([buffer_with(r, seed)[0] for r in ranks]).rank_digests()
               for seed, ranks in enumerate([host, host, other])]
    assert len(digests[0]) == 3 * RANK_DIGEST
    assert digests[0] == digests[1]  # other values, same tensors
    assert first_differing_rank(digests[0], digests[2]) == 1
    assert first_differing_rank(digests[2], digests[0]) == 1
