"""The data plane's round registry: late streams for an ended round are refused at once."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from moshpitd.allreduce import registry as reg
from moshpitd.allreduce.registry import RoundRegistry
from moshpitd.transport.dataplane import READY


class FakeChannel:
    def __init__(self) -> None:
        self.aborted: str | None = None
        self.transport = None
        self.sink: Any = None
        self.sent: list[tuple[int, int]] = []

    def send_nowait(self, kind: int, part: int, payload: bytes = b"", aux: int = 0) -> None:
        self.sent.append((kind, part))

    def abort(self, why: object) -> None:
        self.aborted = str(why)


def test_a_stream_for_an_ended_round_is_refused_at_once() -> None:
    async def scenario() -> tuple[str | None, float, str | None]:
        registry = RoundRegistry(1 << 20)
        gid = b"g" * 16
        accepted: list[int] = []
        rnd = SimpleNamespace(group=SimpleNamespace(group_id=gid), me=1,
                              accept=lambda sender, ch: accepted.append(sender) or "sink")
        registry.register(rnd)  # type: ignore[arg-type]
        live = FakeChannel()
        await registry.route(live, gid, 0, 1)  # type: ignore[arg-type]
        assert accepted == [0] and live.aborted is None and live.sink == "sink"
        assert live.sent == [(READY, 1)]  # the sender may stream now
        registry.unregister(gid)
        late = FakeChannel()
        started = time.monotonic()
        await registry.route(late, gid, 2, 1)  # type: ignore[arg-type]
        assert late.sent == []
        return late.aborted, time.monotonic() - started, live.aborted

    aborted, waited, live_aborted = asyncio.run(scenario())
    assert aborted is not None and "is over here" in aborted
    assert waited < 0.5 < RoundRegistry(1 << 20).stream_wait  # not the stream wait
    assert live_aborted is None


def test_finished_rounds_are_remembered_up_to_a_bound(monkeypatch: Any) -> None:
    monkeypatch.setattr(reg, "MAX_FINISHED", 3)
    registry = RoundRegistry(1 << 20)
    for i in range(5):
        registry.unregister(bytes([i]) * 16)
    assert list(registry._finished) == [bytes([i]) * 16 for i in (2, 3, 4)]
