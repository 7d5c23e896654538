"""Members of weight 0 (listeners: a trainer that just joined) in a butterfly round, in one
event loop over real loopback sockets: they own no span, send no parts and get the weighted
members' mean; one that never shows up holds nobody up."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from moshpitd.allreduce.butterfly import ButterflyRound, RoundResult
from moshpitd.allreduce.codecs import get_codec
from moshpitd.allreduce.group import Group, GroupMember
from moshpitd.allreduce.layout import FlatView, Part, TensorSpec
from moshpitd.allreduce.reducer import PartReducer, ReductionError
from tests.unit.test_round_harness import PART_BYTES, Member, deadlines, members, run_all, stop

N = 100_000


def weighted_group(ms: list[Member], weights: list[float], codec: str = "none") -> Group:
    return Group(b"L" * 16, "k", 0, b"s" * 16,
                 tuple(GroupMember(m.registry.handshake.key.peer_id, "", w,
                                   data_endpoint=m.endpoint)
                       for m, w in zip(ms, weights, strict=True)), codec)


def round_for(group: Group, i: int, m: Member, aggregation: str = "mean") -> ButterflyRound:
    view = FlatView(memoryview(m.values).cast("B"), [TensorSpec("float32", m.values.shape, 0)])
    return ButterflyRound(group, i, view, get_codec(group.codec), m.registry.connect,
                          m.registry.handshake, PART_BYTES, aggregation=aggregation)


async def run_group(weights: list[float], aggregation: str = "mean", absent: int | None = None
                    ) -> tuple[list[RoundResult | BaseException], list[Member], np.ndarray,
                               float, list[int]]:
    """Runs the round of every member but `absent`; returns results, members, the weighted
    mean of the inputs, the seconds it took and each member's planned wire bytes."""
    ms = await members(len(weights), N, seed=len(weights))
    w = np.asarray(weights)
    mean = (np.stack([m.values.astype(np.float64) for m in ms]) * w[:, None]).sum(0) / w.sum()
    group = weighted_group(ms, weights)
    rounds = [round_for(group, i, m, aggregation) for i, m in enumerate(ms)]
    running = [i for i in range(len(ms)) if i != absent]
    for i in running:
        ms[i].registry.register(rounds[i])
    started = time.monotonic()
    out = await run_all([rounds[i] for i in running], [deadlines(10.0)] * len(running))
    took = time.monotonic() - started
    await stop(ms)
    return out, [ms[i] for i in running], mean, took, [rounds[i].plan.wire_bytes()
                                                        for i in running]


@pytest.mark.parametrize("aggregation", ["mean", "trimmed_mean"])
def test_a_listener_owns_no_span_sends_nothing_and_gets_the_mean(aggregation: str) -> None:
    weights = [1.0, 3.0, 0.0] if aggregation == "mean" else [1.0, 1.0, 0.0]
    results, ms, mean, _, wire = asyncio.run(run_group(weights, aggregation))
    for i, (res, m) in enumerate(zip(results, ms, strict=True)):
        assert isinstance(res, RoundResult), res
        assert res.spans == ((0, N, 0b011),) and res.excluded == 0, res.spans
        # two members: the trimmed mean's middle half of the weight is both, i.e. the mean
        np.testing.assert_allclose(m.values, mean, rtol=0, atol=1e-6)
        assert (res.owned == 0) == (i == 2), res.owned
        assert res.bytes_sent + res.bytes_received == pytest.approx(wire[i], rel=0.01)
    listener = results[2]
    assert isinstance(listener, RoundResult)
    assert listener.bytes_sent < 1000 and listener.bytes_received >= 4 * N  # results only


def test_one_weighted_member_among_listeners_gives_everyone_its_values() -> None:
    results, ms, mean, _, _ = asyncio.run(run_group([0.0, 2.0, 0.0]))
    for i, (res, m) in enumerate(zip(results, ms, strict=True)):
        assert isinstance(res, RoundResult), res
        assert res.spans == ((0, N, 0b010),) and res.owned == (N if i == 1 else 0)
        np.testing.assert_array_equal(m.values, mean.astype(np.float32))


def test_a_listener_that_never_comes_holds_nobody_up() -> None:
    """The weight-0 member never starts its round: the others are not waiting for its parts
    nor for a span of its own. They only hold their results for it the start wait (1/8 of the
    10 s budget), not until the deadline."""
    results, ms, mean, took, _ = asyncio.run(run_group([1.0, 2.0, 0.0], absent=2))
    assert took < 2.5
    for res, m in zip(results, ms, strict=True):
        assert isinstance(res, RoundResult), res
        assert res.parts_averaged == res.parts and res.excluded == 0 and not res.excluded_parts
        assert res.spans == ((0, N, 0b011),)
        np.testing.assert_allclose(m.values, mean, rtol=0, atol=1e-6)


def test_listeners_own_a_span_only_when_no_weighted_member_can() -> None:
    def group(*members: tuple[float, bool]) -> Group:
        return Group(b"L" * 16, "k", 0, b"s" * 16,
                     tuple(GroupMember(bytes([i + 1]) * 20, "", w, client_mode=c)
                           for i, (w, c) in enumerate(members)))

    g = group((1.0, False), (0.0, False), (2.0, False))
    assert g.listeners == 0b010 and g.shares == pytest.approx([0.5, 0.0, 0.5])
    # the only weighted member is in client mode: the listeners reduce, as before
    g = group((1.0, True), (0.0, False), (0.0, False))
    assert g.listeners == 0b110 and g.shares == pytest.approx([0.0, 0.5, 0.5])
    g = group((0.0, False), (0.0, False))  # no mean at all: the round is skipped
    assert g.listeners == 0 and g.shares == pytest.approx([0.5, 0.5])


def test_a_reducer_takes_nothing_from_a_listener_and_never_waits_for_it() -> None:
    red = PartReducer([Part(0, 0, 0, 4, 0)], {0: np.dtype(np.float32)}, senders=3,
                      listeners=0b100)
    assert red.lacking(2) == 0 and red.missing(0) == 0b011
    with pytest.raises(ReductionError, match="weight 0"):
        red.add(0, 2, 0.0, np.ones(4, dtype=np.float32))
    assert not red.add(0, 0, 1.0, np.ones(4, dtype=np.float32))
    assert red.add(0, 1, 3.0, np.full(4, 5.0, dtype=np.float32))  # final without sender 2
    assert red.mask(0) == 0b011 and np.array_equal(red.result(0), np.full(4, 4.0))
