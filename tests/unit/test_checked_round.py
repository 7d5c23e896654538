"""Checked rounds in one event loop (members over real loopback sockets, as in
test_round_harness.py): honest owners always pass, a lying owner's span is never applied and
the owner is named, whatever the codec and aggregation."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest

from moshpitd.allreduce.butterfly import ButterflyRound, RoundResult
from moshpitd.allreduce.checks import make_claim
from moshpitd.allreduce.codecs import Codec, get_codec
from moshpitd.allreduce.layout import FlatView, TensorSpec
from moshpitd.allreduce.verifier import SpanVerifier
from moshpitd.hooks import NO_HOOKS, Hooks
from tests.unit.test_round_harness import (
    PART_BYTES,
    Member,
    StallAfterFirstPart,
    deadlines,
    group_of,
    members,
    run_all,
    stop,
)


class Liar(Hooks):
    """An owner whose every result says `value` (or, with `every`, whose results are honest
    but for one part in `every`, shifted by `value`)."""

    def __init__(self, value: float = 1000.0, every: int = 0) -> None:
        self.value, self.every = value, every

    async def before_result(self, sent: int, payload: memoryview | bytes, codec: Codec,
                            numel: int, dtype: np.dtype) -> memoryview | bytes:
        if not payload:
            return payload
        if self.every:
            if sent % self.every:
                return payload
            values = np.array(codec.decode(memoryview(bytes(payload)), numel, dtype),
                              dtype=np.float32)
            values += self.value
            return codec.encode(values)
        return codec.encode(np.full(numel, self.value, dtype=np.float32))


def checked_round(group, i: int, m: Member, codec: str, aggregation: str,  # type: ignore[no-untyped-def]
                  hooks: Hooks = NO_HOOKS) -> ButterflyRound:
    view = FlatView(memoryview(m.values).cast("B"), [TensorSpec("float32", m.values.shape, 0)])
    return ButterflyRound(group, i, view, get_codec(codec), m.registry.connect,
                          m.registry.handshake, PART_BYTES, hooks, aggregation,
                          checked=True)


async def one_round(ms: list[Member], codec: str, aggregation: str,
                    hooks: dict[int, Hooks] | None = None) -> list[RoundResult]:
    group = group_of(ms, codec)  # unequal weights: robust aggregations cap them, mean not
    group = replace(group, members=tuple(replace(m, weight=1.0 + 2 * i)
                                         for i, m in enumerate(group.members)))
    rounds = [checked_round(group, i, m, codec, aggregation, (hooks or {}).get(i, NO_HOOKS))
              for i, m in enumerate(ms)]
    for m, r in zip(ms, rounds, strict=True):
        m.registry.register(r)
    try:
        results = await run_all(rounds, [deadlines(4.0) for _ in ms])
    finally:
        for m in ms:
            m.registry.unregister(group.group_id)
    for r in results:
        assert isinstance(r, RoundResult), r
    return results  # type: ignore[return-value]


def spans(result: RoundResult) -> list[tuple[int, int, int]]:
    return list(result.spans)


@pytest.mark.parametrize("codec", ["none", "fp16", "int4"])
@pytest.mark.parametrize("aggregation", ["mean", "trimmed_mean"])
def test_honest_owners_pass_every_check(codec: str, aggregation: str) -> None:
    """Many honest rounds, values spread over decades (each codec rounds at the edge of what
    the tolerance allows): no owner is ever accused, and every span is applied."""
    async def scenario() -> None:
        ms = await members(4, 60_000, seed=7)
        try:
            rng = np.random.default_rng(3)
            for _ in range(6):
                for m in ms:
                    m.values[:] = (rng.standard_normal(m.values.size)
                                   * 10.0 ** rng.uniform(-6, 3, m.values.size))
                results = await one_round(ms, codec, aggregation)
                for r in results:
                    assert r.lied == () and r.unchecked == 0
                    assert r.parts_averaged == r.parts
                if codec == "none":  # (an owner keeps its own span unrounded by the codec)
                    assert all(np.array_equal(ms[0].values, m.values) for m in ms)
        finally:
            await stop(ms)

    asyncio.run(scenario())


@pytest.mark.parametrize("aggregation", ["mean", "trimmed_mean"])
@pytest.mark.parametrize("codec", ["none", "int4"])
def test_a_lying_owner_is_named_and_its_span_never_applied(aggregation: str,
                                                           codec: str) -> None:
    async def scenario() -> None:
        ms = await members(4, 50_000, seed=1)
        try:
            before = [m.values.copy() for m in ms]
            results = await one_round(ms, codec, aggregation, {1: Liar()})
            for i, (m, r) in enumerate(zip(ms, results, strict=True)):
                if i == 1:
                    continue
                assert r.lied == (1,)
                assert not np.any(m.values == 1000.0)
                for lo, hi, mask in r.spans:  # the liar's span: local values, mask 0
                    if mask == 0:
                        np.testing.assert_array_equal(m.values[lo:hi], before[i][lo:hi])
                owned = [s for s in r.spans if s[2] == 0]
                assert owned, "the liar's span was applied"
                assert r.parts_averaged < r.parts
        finally:
            await stop(ms)

    asyncio.run(scenario())


def test_a_rare_lie_is_caught_within_a_bounded_number_of_rounds() -> None:
    """A lie on a share f of a span's elements escapes a round's 128 spots with probability
    (1 - f)^128: one part in a thousand is caught within 36 rounds with 99 % probability. Here
    an owner shifts one part in 4 of its span; the first round catches it (it
    escapes with probability 1e-16), and so does every later one."""
    async def scenario() -> None:
        ms = await members(4, 4 * 16 * 4096, seed=2)
        caught = 0
        try:
            for _ in range(3):
                results = await one_round(ms, "none", "mean", {2: Liar(value=5.0, every=4)})
                caught += sum(1 for i, r in enumerate(results) if i != 2 and r.lied == (2,))
        finally:
            await stop(ms)
        assert caught >= 3

    asyncio.run(scenario())


def test_a_contributor_that_claims_other_values_gets_no_honest_owner_accused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Member 3 says, signed, that it sent other values than it did. Every owner checks claims
    against what the claimant's stream carried, relays a dispute instead of the false claim,
    and names the claimant; the other members keep their values for those spans and accuse
    nobody. The liar's own span (its claim there is its own values) is checked as usual."""
    original = SpanVerifier.on_seeds

    def lying(self: SpanVerifier, payload: memoryview) -> bytes | None:
        claim = original(self, payload)
        if claim is None or self.plan.me != 3:
            return claim
        values = self.claims[3] + 5.0
        return make_claim(self.key, self.plan.group.digest, self.owner, 3, self.at_digest,
                          values)

    monkeypatch.setattr(SpanVerifier, "on_seeds", lying)

    async def scenario() -> None:
        ms = await members(4, 50_000, seed=4)
        try:
            before = [m.values.copy() for m in ms]
            results = await one_round(ms, "none", "mean")
            for i in range(3):  # every honest member is an owner that caught the claimant
                r = results[i]
                assert r.lied == (3,), r.lied
                for lo, hi, mask in r.spans:
                    if mask == 0:
                        np.testing.assert_array_equal(ms[i].values[lo:hi], before[i][lo:hi])
                assert r.unchecked == 2  # the other honest owners' spans: disputed
        finally:
            await stop(ms)

    asyncio.run(scenario())


def test_a_member_that_stops_mid_round_costs_only_the_parts_its_values_are_in() -> None:
    """Member 2 sends one part to every owner and falls silent: the owners exclude it at the
    deadline, keep that part of it in their results (as unchecked rounds do), and its claim
    never comes. Those parts of members 0's and 1's spans cannot be checked and keep the
    members' own values; every other part is checked and applied, and nobody is accused."""
    async def scenario() -> None:
        ms = await members(3, 3 * 4 * 16384, seed=5)
        try:
            before = [m.values.copy() for m in ms]
            group = group_of(ms, "none")
            stall = StallAfterFirstPart()
            rounds = [checked_round(group, i, m, "none", "mean", stall if i == 2 else NO_HOOKS)
                      for i, m in enumerate(ms)]
            for m, r in zip(ms, rounds, strict=True):
                m.registry.register(r)
            silent = asyncio.create_task(rounds[2].run(deadlines(0.6)))
            results = await asyncio.gather(*(r.run(deadlines(0.6)) for r in rounds[:2]))
            stall.release.set()
            await asyncio.gather(silent, return_exceptions=True)
            for i, r in enumerate(results):
                assert r.lied == ()
                # equal spans; ours is ours, and member 2's own span has its own claim
                other = 1 - i
                span = (other * 4 * 16384, (other + 1) * 4 * 16384)
                kept = [(lo, hi) for lo, hi, mask in r.spans if mask == 0]
                applied = [mask for lo, hi, mask in r.spans if mask and span[0] <= lo < span[1]]
                assert kept and applied, r.spans
                assert all(not mask >> 2 & 1 for mask in applied), r.spans  # unchecked: kept
                for lo, hi in kept:
                    np.testing.assert_array_equal(ms[i].values[lo:hi], before[i][lo:hi])
        finally:
            await stop(ms)

    asyncio.run(scenario())


@pytest.mark.parametrize("aggregation", ["mean", "trimmed_mean"])
@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "int8"])
def test_honest_owners_pass_over_mixed_dtypes(codec: str, aggregation: str) -> None:
    """float16, float32 and float64 tensors in one request (their own roundings, the float64
    run accumulated in float64, values down to the subnormals), under every other codec: no
    owner is accused."""
    sizes = {"float16": 30_000, "float32": 40_000, "float64": 30_000}

    async def scenario() -> None:
        ms = await members(4, 1, seed=9)
        try:
            rng = np.random.default_rng(11)
            bufs, specs, offset = [], [], 0
            for dtype, n in sizes.items():
                specs.append(TensorSpec(dtype, (n,), offset))
                offset += n * np.dtype(dtype).itemsize
            for _ in ms:
                buf = np.zeros(offset, dtype=np.uint8)
                for spec in specs:
                    arr = np.frombuffer(buf, dtype=spec.dtype, count=spec.numel,
                                        offset=spec.offset)
                    # down to float16's (and float32's) subnormals: they round by a step
                    arr[:] = rng.standard_normal(spec.numel) * 10.0 ** rng.uniform(-42, 3,
                                                                                   spec.numel)
                bufs.append(buf)
            group = group_of(ms, codec)
            group = replace(group, members=tuple(replace(m, weight=1.0 + i)
                                                 for i, m in enumerate(group.members)))
            rounds = [ButterflyRound(group, i, FlatView(memoryview(b).cast("B"), specs),
                                     get_codec(codec), m.registry.connect,
                                     m.registry.handshake, PART_BYTES, NO_HOOKS,
                                     aggregation, checked=True)
                      for i, (m, b) in enumerate(zip(ms, bufs, strict=True))]
            for m, r in zip(ms, rounds, strict=True):
                m.registry.register(r)
            results = await run_all(rounds, [deadlines(4.0) for _ in ms])
            for r in results:
                assert isinstance(r, RoundResult), r
                assert r.lied == () and r.unchecked == 0 and r.parts_averaged == r.parts
        finally:
            await stop(ms)

    asyncio.run(scenario())


def test_a_seed_of_another_length_is_refused_at_its_reveal() -> None:
    """A member that commits to a 33-byte seed and reveals it would have the owner pack it as
    32 bytes, and every other member would then see a seed that matches no commitment and
    name the honest owner: the owner refuses it at the REVEAL (and excludes its sender)."""
    from moshpitd.allreduce.checks import CheckError, commitment
    from moshpitd.allreduce.ownercheck import OwnerCheck

    class Plan:  # what on_commit and on_reveal read
        me = 0

    check = OwnerCheck(Plan(), None)  # type: ignore[arg-type]
    seed = bytes(33)
    check.on_commit(1, memoryview(commitment(seed)))
    check.fix_commitments(0)
    with pytest.raises(CheckError):
        check.on_reveal(1, memoryview(seed))
    assert check.seeds == {}
