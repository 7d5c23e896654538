"""Fault hooks (allreduce/faults.py) fire where the fault tests rely on them: the crashes and
stall-send's marker wait until every sender's stream reached the victim; stall-send marks the
round once every link that has a second part stalled; poison-results spoils only the first
result on each stream; a plan for another round does nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from moshpitd.allreduce import faults
from moshpitd.allreduce.codecs import CODECS
from moshpitd.allreduce.faults import FaultPlan, poisoned


def test_stall_send_fires_after_every_link_stalled(tmp_path: Path) -> None:
    marker = tmp_path / "fired"

    async def run() -> list[bool]:
        plan = FaultPlan("stall-send", 1, str(marker))
        plan.begin_round([3, 1, 2], senders=1)  # the one-part link never reaches a 2nd part
        fired = []
        tasks = []
        for _ in range(2):
            await plan.during_send(0)  # the first part always goes out
            tasks.append(asyncio.create_task(plan.during_send(1)))
            await asyncio.sleep(0)
            fired.append(marker.exists())
        plan.accepted_sender()
        fired.append(marker.exists())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return fired

    assert asyncio.run(run()) == [False, False, True]


def test_poison_only_first_result_of_the_faulty_round(tmp_path: Path) -> None:
    plan = FaultPlan("poison-results", 2, str(tmp_path / "fired"))
    plan.begin_round([1])
    assert not plan.poison_result(0)
    plan.begin_round([1])
    assert [plan.poison_result(n) for n in range(3)] == [True, False, False]
    values = np.arange(5, dtype=np.float32)
    for codec in CODECS.values():
        payload = codec.encode(values)
        before = bytes(payload)
        with np.errstate(all="ignore"):
            bad = codec.decode(poisoned(codec, payload, 5, values.dtype), 5, values.dtype)
        assert not np.isfinite(bad).all() and bytes(payload) == before, codec


def test_trickle_send_sleeps_before_every_part(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = FaultPlan("trickle-send", 1)
    plan.begin_round([4])
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    async def run() -> None:
        for n in range(4):
            await plan.during_send(n)

    monkeypatch.setattr(faults.asyncio, "sleep", fake_sleep)
    asyncio.run(run())
    assert slept == [faults.TRICKLE_SECONDS] * 4


class Crashed(Exception):
    pass


def fake_exit(code: int) -> None:
    raise Crashed(code)


@pytest.mark.parametrize("kind", ["crash-before-send", "crash-while-reducing"])
def test_crashes_wait_for_every_sender(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    monkeypatch.setattr(faults.os, "_exit", fake_exit)
    plan = FaultPlan(kind, 1)
    plan.begin_round([3, 3], senders=2)
    plan.while_reducing()  # a contribution before everyone is in: not yet
    plan.accepted_sender()
    if kind == "crash-while-reducing":
        plan.while_reducing()
    try:
        plan.accepted_sender()
    except Crashed:
        return
    raise AssertionError("no crash once every sender's stream arrived")


def test_crash_mid_send_waits_for_every_sender(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults.os, "_exit", fake_exit)

    async def run() -> bool:
        plan = FaultPlan("crash-mid-send", 1)
        plan.begin_round([3, 3], senders=1)
        await plan.during_send(0)
        task = asyncio.create_task(plan.during_send(1))
        await asyncio.sleep(0.01)
        early = task.done()
        plan.accepted_sender()
        try:
            await task
        except Crashed:
            return not early
        return False

    assert asyncio.run(run())
