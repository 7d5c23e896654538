"""The replicas' local reduce (moshpitd/local/reduce.py), its deadline and the agreement check
of a local group: pure functions, checked against float64 references."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moshpitd.allreduce.deadlines import DeadlinePolicy
from moshpitd.allreduce.layout import TensorSpec
from moshpitd.clock import RoundClock
from moshpitd.local.group import disagreement
from moshpitd.local.reduce import CHUNK, Scratch, copy_out, local_weights, weighted_mean
from moshpitd.rounds import AverageRequest

DTYPES = [np.float16, np.float32, np.float64]


def replicas(n: int, sizes: list[int], seed: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[(rng.standard_normal(size) * 100).astype(DTYPES[k % 3])
             for k, size in enumerate(sizes)] for _ in range(n)]


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 5), sizes=st.lists(st.sampled_from([0, 1, 7, CHUNK - 1, CHUNK + 3]),
                                           min_size=1, max_size=4),
       weights=st.lists(st.floats(0.0, 100.0), min_size=5, max_size=5), seed=st.integers(0, 99))
def test_weighted_mean_matches_float64(n: int, sizes: list[int], weights: list[float],
                                       seed: int) -> None:
    sources = replicas(n, sizes, seed)
    specs = [TensorSpec(np.dtype(DTYPES[k % 3]).name, (size,), 0)
             for k, size in enumerate(sizes)]
    scratch = Scratch(specs)
    assert weighted_mean(scratch.arrays, sources, weights[:n]) == {}
    shares = local_weights(weights[:n])
    for k, out in enumerate(scratch.arrays):
        want = sum(s * src[k].astype(np.float64) for s, src in zip(shares, sources, strict=True))
        assert out.dtype == sources[0][k].dtype
        # within a few roundings of the dtype at the inputs' scale (float16 accumulates in
        # float32, then rounds once)
        scale = np.max([np.abs(src[k].astype(np.float64)) for src in sources], axis=0)
        err = np.abs(out.astype(np.float64) - want)
        assert (err <= 2 * n * np.finfo(out.dtype).eps * scale).all()


def test_all_zero_weights_give_the_plain_mean() -> None:
    assert local_weights([0.0, 0.0]) == [0.5, 0.5]
    assert local_weights([1.0, 3.0]) == [0.25, 0.75]


def test_a_replica_with_nan_or_inf_is_named_with_its_tensor() -> None:
    sources = replicas(3, [10, CHUNK + 5], 1)
    sources[1][1][CHUNK + 2] = np.inf  # in the second chunk of tensor 1 (float32)
    sources[2][0][3] = np.nan
    scratch = Scratch([TensorSpec("float16", (10,), 0), TensorSpec("float32", (CHUNK + 5,), 0)])
    assert weighted_mean(scratch.arrays, sources, [1, 1, 1]) == {2: 0}  # the first found
    assert weighted_mean(scratch.arrays, sources[:2], [1, 1]) == {1: 1}
    assert weighted_mean(scratch.arrays, sources[:1], [1]) == {}
    np.testing.assert_array_equal(scratch.arrays[1], sources[0][1])


def test_copy_out_writes_every_replica() -> None:
    sources = replicas(3, [5, 9], 2)
    scratch = Scratch([TensorSpec("float16", (5,), 0), TensorSpec("float32", (9,), 0)])
    weighted_mean(scratch.arrays, sources, [1, 2, 3])
    copy_out(scratch.arrays, sources)
    for src in sources:
        for got, want in zip(src, scratch.arrays, strict=True):
            np.testing.assert_array_equal(got, want)


def test_scratch_aligns_its_tensors() -> None:
    scratch = Scratch([TensorSpec("float16", (3,), 0), TensorSpec("float64", (2,), 0)])
    assert [s.offset for s in scratch.specs] == [0, 64]
    assert all(a.ctypes.data % 64 == scratch.arrays[0].ctypes.data % 64
               for a in scratch.arrays)


@pytest.mark.parametrize("timeout,attempt,wait", [(30.0, 5.0, 5.0), (4.0, 5.0, 2.0),
                                                  (30.0, 0.5, 0.5)])
def test_local_deadline_is_one_attempt_at_most_half_the_request(
        timeout: float, attempt: float, wait: float) -> None:
    clock = RoundClock(timeout, attempt, DeadlinePolicy(), now=100.0)
    assert clock.local_deadline() == pytest.approx(100.0 + wait)


def request(**kw: object) -> AverageRequest:
    base: dict[str, object] = dict(key="k", specs=(TensorSpec("float32", (4,), 0),),
                                   local_world=2)
    return AverageRequest(**{**base, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize("other,shards,says", [
    (request(local_world=3), False, "says local_world=3, the first said 2"),
    (request(local_rank=1), False,
     "is in the other mode: the group holds replicas (no local_rank)"),
    (request(codec="fp16"), False, "asks codec='fp16', the first asked 'none'"),
    (request(specs=(TensorSpec("float32", (5,), 0),)), False,
     "sent tensor 0 as float32 [5], the first as float32 [4]"),
    (request(specs=()), False, "sent 0 tensors, the first sent 1"),
    (request(specs=(TensorSpec("float32", (5,), 0),), weight=3.0, timeout=9.0), True, None),
])
def test_disagreement_says_what_differs(other: AverageRequest, shards: bool,
                                        says: str | None) -> None:
    first = request(local_rank=0) if shards else request()
    if shards and other.local_rank is None:
        other = AverageRequest(**{**other.__dict__, "local_rank": 1})
    assert disagreement(first, other, shards) == says


def test_moshpit_status_shows_the_local_groups(capsys: pytest.CaptureFixture[str]) -> None:
    from moshpit.cli import show_status

    status = {"peer_id": "ab", "dht": "d", "grpc": "g", "dht_peers": 1, "rounds_done": 0,
              "rounds_failed": 0, "local_groups": {
                  "run1": {"mode": "replicas", "local_world": 3, "ranks": [0, 2],
                           "state": "gathering"}}}
    show_status({"status": status})
    assert "local group  run1: replicas, ranks 0, 2 of 3, gathering" in capsys.readouterr().out
