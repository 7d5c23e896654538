"""Fault hooks (moshpitd/faults.py) fire where the fault tests rely on them: the crashes and
stall-send's marker wait until every sender's stream reached the victim; stall-send marks the
round once every link that has a second part stalled; poison-results spoils only the first
result on each stream; a plan for another round does nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from moshpitd import faults
from moshpitd.allreduce.codecs import CODECS
from moshpitd.faults import FaultPlan, poisoned


def test_stall_send_fires_after_every_link_stalled(tmp_path: Path) -> None:
    marker = tmp_path / "fired"

    async def run() -> list[bool]:
        plan = FaultPlan("stall-send", 1, str(marker))
        plan.begin_round([3, 1, 2], senders=1)  # the one-part link never reaches a 2nd part
        fired = []
        tasks = []
        for _ in range(2):
            await plan.before_part(0)  # the first part always goes out
            tasks.append(asyncio.create_task(plan.before_part(1)))
            await asyncio.sleep(0)
            fired.append(marker.exists())
        plan.sender_accepted()
        fired.append(marker.exists())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return fired

    assert asyncio.run(run()) == [False, False, True]


def test_poison_only_first_result_of_the_faulty_round(tmp_path: Path) -> None:
    plan = FaultPlan("poison-results", 2, str(tmp_path / "fired"))
    values = np.arange(5, dtype=np.float32)
    codec = CODECS["none"]
    payload = codec.encode(values)

    async def spoiled(sent: int) -> bool:
        out = await plan.before_result(sent, payload, codec, 5, values.dtype)
        return not np.isfinite(codec.decode(memoryview(out), 5, values.dtype)).all()

    async def run() -> list[bool]:
        plan.begin_round([1], 1)
        first = [await spoiled(0)]
        plan.begin_round([1], 1)
        return first + [await spoiled(n) for n in range(3)]

    assert asyncio.run(run()) == [False, True, False, False]
    for each in CODECS.values():
        encoded = each.encode(values)
        before = bytes(encoded)
        with np.errstate(all="ignore"):
            bad = each.decode(poisoned(each, encoded, 5, values.dtype), 5, values.dtype)
        assert not np.isfinite(bad).all() and bytes(encoded) == before, each
    for codec in CODECS.values():
        payload = codec.encode(values)
        before = bytes(payload)
        with np.errstate(all="ignore"):
            bad = codec.decode(poisoned(codec, payload, 5, values.dtype), 5, values.dtype)
        assert not np.isfinite(bad).all() and bytes(payload) == before, codec


def test_trickle_send_sleeps_before_every_part(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = FaultPlan("trickle-send", 1)
    plan.begin_round([4], 0)
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    async def run() -> None:
        for n in range(4):
            await plan.before_part(n)

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
    plan.contribution()  # a contribution before everyone is in: not yet
    plan.sender_accepted()
    if kind == "crash-while-reducing":
        plan.contribution()
    try:
        plan.sender_accepted()
    except Crashed:
        return
    raise AssertionError("no crash once every sender's stream arrived")


def test_crash_mid_send_waits_for_every_sender(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults.os, "_exit", fake_exit)

    async def run() -> bool:
        plan = FaultPlan("crash-mid-send", 1)
        plan.begin_round([3, 3], senders=1)
        await plan.before_part(0)
        task = asyncio.create_task(plan.before_part(1))
        for _ in range(10):  # let it run as far as it can go without the last sender
            await asyncio.sleep(0)
        early = task.done()
        plan.sender_accepted()
        try:
            await task
        except Crashed:
            return not early
        return False

    assert asyncio.run(run())


def test_production_daemon_never_loads_the_fault_module(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """The fault hooks are installed by the entry point only when MOSHPITD_FAULT is set."""
    import subprocess
    import sys

    code = ("import sys, moshpitd.service as s; from moshpitd.hooks import NO_HOOKS; "
            "assert s.installed_hooks() is NO_HOOKS; assert 'moshpitd.faults' not in sys.modules; "
            "print('clean')")
    env = {k: v for k, v in __import__("os").environ.items() if k != "MOSHPITD_FAULT"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "clean", out.stderr
    monkeypatch.setenv("MOSHPITD_FAULT", "stall-reduce@2")
    from moshpitd.service import installed_hooks

    hooks = installed_hooks()
    assert isinstance(hooks, FaultPlan) and (hooks.kind, hooks.at_round) == ("stall-reduce", 2)
