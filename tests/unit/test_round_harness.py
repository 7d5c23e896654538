"""The butterfly round in one event loop: several members, each with its own data-plane
listener on a real loopback socket, run `ButterflyRound.run` against each other. The waits,
the exclusion paths and the deadlines are checked in milliseconds, without daemons."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np
import pytest

from moshpitd.allreduce.butterfly import ButterflyRound, RoundResult
from moshpitd.allreduce.codecs import get_codec
from moshpitd.allreduce.deadlines import DeadlinePolicy, RoundDeadlines
from moshpitd.allreduce.group import Group, GroupMember
from moshpitd.allreduce.layout import FlatView, TensorSpec
from moshpitd.allreduce.registry import RoundRegistry
from moshpitd.clock import RoundClock
from moshpitd.hooks import NO_HOOKS, Hooks
from moshpitd.transport.handshake import Handshake

PART_BYTES = 64 << 10


@dataclass
class Member:
    registry: RoundRegistry
    endpoint: str
    values: np.ndarray


async def members(n: int, elems: int, seed: int = 0, encrypt: bool = False) -> list[Member]:
    """Members with a peer key each (their streams prove it), encrypting or not."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        reg = RoundRegistry(PART_BYTES * 2 + 4096, Handshake(encrypt=encrypt), stream_wait=2.0)
        port = await reg.start("127.0.0.1", 0)
        out.append(Member(reg, f"127.0.0.1:{port}", rng.standard_normal(elems)
                          .astype(np.float32)))
    return out


def round_of(group: Group, i: int, m: Member, codec: str, hooks: Hooks = NO_HOOKS
             ) -> ButterflyRound:
    buf = memoryview(m.values).cast("B")
    view = FlatView(buf, [TensorSpec("float32", m.values.shape, 0)])
    return ButterflyRound(group, i, view, get_codec(codec), m.registry.connect,
                          m.registry.handshake, PART_BYTES, hooks)


def group_of(ms: list[Member], codec: str, extra: list[Member] | None = None) -> Group:
    """The members (then `extra`, listed but not running), each under its own peer id."""
    listed = ms + (extra or [])
    return Group(b"G" * 16, "k", 0, b"s" * 16,
                 tuple(GroupMember(m.registry.handshake.key.peer_id, "", 1.0,
                                   data_endpoint=m.endpoint) for m in listed), codec)


async def run_all(rounds: list[ButterflyRound], make: list[RoundDeadlines]
                  ) -> list[RoundResult | BaseException]:
    return list(await asyncio.gather(*(r.run(d) for r, d in zip(rounds, make, strict=True)),
                                     return_exceptions=True))


def deadlines(budget: float, now: float | None = None) -> RoundDeadlines:
    clock = RoundClock(60.0, 5.0, DeadlinePolicy(floor=budget, factor=0.0))
    return clock.allreduce(0, now)


async def stop(ms: list[Member]) -> None:
    for m in ms:
        await m.registry.stop()
        if m.registry.server is not None:
            await m.registry.server.wait_closed()


@pytest.mark.parametrize(("codec", "encrypt"), [("none", False), ("none", True),
                                               ("int8", True)])
def test_members_agree_on_the_mean(codec: str, encrypt: bool) -> None:
    async def scenario() -> tuple[list[RoundResult | BaseException], np.ndarray, list[Member]]:
        ms = await members(4, 100_000, encrypt=encrypt)
        mean = np.mean([m.values.astype(np.float64) for m in ms], axis=0)
        group = group_of(ms, codec)
        rounds = [round_of(group, i, m, codec) for i, m in enumerate(ms)]
        for r, m in zip(rounds, ms, strict=True):
            m.registry.register(r)
        out = await run_all(rounds, [deadlines(5.0)] * 4)
        await stop(ms)
        return out, mean, ms

    results, mean, ms = asyncio.run(scenario())
    tol = 1e-6 if codec == "none" else 0.05
    for res, m in zip(results, ms, strict=True):
        assert isinstance(res, RoundResult), res
        assert res.parts_averaged == res.parts and res.excluded == 0
        assert res.spans == ((0, 100_000, 0b1111),)
        np.testing.assert_allclose(m.values, mean, atol=tol)
    assert np.array_equal(ms[0].values, ms[3].values) or codec != "none"


def test_dead_member_is_excluded_at_once() -> None:
    """A member whose data plane refuses connections is excluded as a sender and as an owner
    right away: the others finish long before the deadline, their span without it."""
    async def scenario() -> tuple[list[RoundResult | BaseException], float, list[Member]]:
        ms = await members(3, 50_000)
        dead = ms.pop()
        await stop([dead])  # its port now refuses connections
        group = group_of(ms, "none", [dead])
        rounds = [round_of(group, i, m, "none") for i, m in enumerate(ms)]
        for r, m in zip(rounds, ms, strict=True):
            m.registry.register(r)
        started = time.monotonic()
        out = await run_all(rounds, [deadlines(10.0)] * 2)
        took = time.monotonic() - started
        await stop(ms)
        return out, took, ms

    results, took, ms = asyncio.run(scenario())
    assert took < 2.0  # the deadline is 10 s away
    for res in results:
        assert isinstance(res, RoundResult), res
        assert res.excluded == 0b100 and res.excluded_parts.get("disconnected", 0) > 0
        masks = {mask for _, _, mask in res.spans}
        assert masks == {0b011, 0}  # the dead member's span keeps local values
    np.testing.assert_array_equal(ms[0].values[:1000], ms[1].values[:1000])


class StallAfterFirstPart(Hooks):
    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def before_part(self, sent: int) -> None:
        if sent == 1:
            await self.release.wait()


def test_silent_sender_is_excluded_at_the_deadline_not_before() -> None:
    async def scenario() -> tuple[list[RoundResult | BaseException], list[float], float]:
        ms = await members(3, 200_000)
        group = group_of(ms, "none")
        stall = StallAfterFirstPart()
        rounds = [round_of(group, i, m, "none", stall if i == 2 else NO_HOOKS)
                  for i, m in enumerate(ms)]
        for r, m in zip(rounds, ms, strict=True):
            m.registry.register(r)
        d = deadlines(0.6)
        started = time.monotonic()
        ends: list[float] = []

        async def timed(r: ButterflyRound, dl: RoundDeadlines) -> RoundResult:
            try:
                return await r.run(dl)
            finally:
                ends.append(time.monotonic() - started)

        tasks = [asyncio.create_task(timed(r, d)) for r in rounds[:2]]
        silent = asyncio.create_task(rounds[2].run(d))
        out = list(await asyncio.gather(*tasks, return_exceptions=True))
        stall.release.set()
        await asyncio.gather(silent, return_exceptions=True)
        await stop(ms)
        return out, ends, d.deadline - started

    results, ends, deadline = asyncio.run(scenario())
    for res in results:
        assert isinstance(res, RoundResult), res
        assert res.excluded & 0b100 and res.excluded_parts.get("timeout", 0) > 0
    assert min(ends) >= deadline - 0.05  # excluded at the deadline, not before
    assert max(ends) < deadline + 2.0


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_learnt_budget_is_factor_times_the_round(codec: str) -> None:
    """The clock learns a rate from a finished round's wire bytes and budgets the next round
    of the same plan in the same unit: factor x the observed round time, for any codec
    (bytes on the wire per element differ 4x between none and int8)."""
    async def scenario() -> tuple[RoundResult, int]:
        ms = await members(2, 1_000_000)
        group = group_of(ms, codec)
        rounds = [round_of(group, i, m, codec) for i, m in enumerate(ms)]
        for r, m in zip(rounds, ms, strict=True):
            m.registry.register(r)
        out = await run_all(rounds, [deadlines(30.0)] * 2)
        await stop(ms)
        assert isinstance(out[0], RoundResult), out[0]
        return out[0], rounds[0].plan.wire_bytes()

    result, wire = asyncio.run(scenario())
    assert result.bytes_sent + result.bytes_received == pytest.approx(wire, rel=0.01)
    policy = DeadlinePolicy(floor=0.0, alpha=1.0, min_learn_bytes=0)
    clock = RoundClock(600.0, 5.0, policy)
    clock.learn(result.bytes_sent + result.bytes_received, result.seconds)
    budget = clock.allreduce(wire).budget
    assert budget == pytest.approx(policy.factor * result.seconds, rel=0.01)
