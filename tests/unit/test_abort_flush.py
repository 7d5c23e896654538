"""A member that leaves a round says so: its ABORT reaches the peer even when frames it wrote
before are still in its socket's buffer (transport/dataplane.py flush_aborts), and the peer
counts that member once, as `aborted`, not again as a dropped stream (allreduce/ownerlink.py
OwnerLink)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import numpy as np
import pytest
import uvloop

from moshpitd.allreduce.codecs import get_codec
from moshpitd.allreduce.group import Group, GroupMember
from moshpitd.allreduce.layout import FlatView, TensorSpec
from moshpitd.allreduce.ownerlink import OwnerLink, ReadyGate
from moshpitd.allreduce.plan import Ledger, RoundPlan
from moshpitd.transport.dataplane import (
    ABORT,
    BAD_VALUES,
    HEADER,
    LEFT,
    RESULT,
    Channel,
    connect,
    flush_aborts,
    serve,
)

T = TypeVar("T")
FRAMES, FRAME_BYTES = 48, 1 << 20  # 48 MiB: far more than the socket buffers take (tcp_[rw]mem)


class Recorder:
    def __init__(self) -> None:
        self.frames: list[tuple[int, int, int]] = []  # kind, part, aux
        self.closed = asyncio.get_running_loop().create_future()

    def buffer_for(self, kind: int, part: int, length: int, aux: int) -> memoryview | None:
        return None

    def on_frame(self, kind: int, part: int, payload: memoryview, aux: int) -> None:
        self.frames.append((kind, part, aux))

    def on_close(self, exc: BaseException | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


async def leave_with_results_unsent(flush: bool) -> list[tuple[int, int, int]]:
    """A reducer that wrote FRAMES results its peer has not read yet, then leaves the round."""
    recorder = Recorder()
    receivers: list[Channel] = []

    def accept() -> Channel:
        receivers.append(Channel(recorder, max_payload=FRAME_BYTES))
        return receivers[-1]

    server = await serve("127.0.0.1", 0, accept)
    port = server.sockets[0].getsockname()[1]
    sender = await connect("127.0.0.1", port, Recorder(), FRAME_BYTES)
    while not receivers or receivers[0].transport is None:
        await asyncio.sleep(0.001)
    receivers[0].transport.pause_reading()  # the peer is busy: our results queue up
    results = memoryview(bytearray(FRAME_BYTES))
    transport = sender.transport
    assert transport is not None
    for i in range(FRAMES):
        transport.writelines((HEADER.pack(RESULT, 0, 0, i, FRAME_BYTES, 1), results))
    assert transport.get_write_buffer_size() > 0
    sender.abort("the peer left the round", code=LEFT)
    receivers[0].transport.resume_reading()
    if flush:
        await flush_aborts([sender], timeout=10.0)
    sender.close()
    await asyncio.wait_for(recorder.closed, 10.0)
    server.close()
    return recorder.frames


def run(loop: str, coro: Coroutine[Any, Any, T]) -> T:
    """The daemon runs on uvloop; asyncio's loop is its fallback."""
    return uvloop.run(coro) if loop == "uvloop" else asyncio.run(coro)


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_an_abort_behind_unsent_results_arrives_after_them(loop: str) -> None:
    frames = run(loop, leave_with_results_unsent(flush=True))
    assert frames == [(RESULT, i, 1) for i in range(FRAMES)] + [(ABORT, 0, LEFT)]


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_without_the_flush_the_abort_is_dropped_with_them(loop: str) -> None:
    """What flush_aborts is for: closing at once drops the queued results and the ABORT."""
    frames = run(loop, leave_with_results_unsent(flush=False))
    assert (ABORT, 0, LEFT) not in frames and len(frames) < FRAMES


class Counted:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, str]] = []

    def exclude(self, sender: int, why: str, fault: str = "other") -> None:
        self.calls.append(("exclude", sender, fault))

    def lost(self, sender: int, why: str, fault: str) -> None:
        self.calls.append(("lost", sender, fault))


def make_link() -> tuple[OwnerLink, Counted]:
    buffer = memoryview(bytearray(4 * 1000))
    view = FlatView(buffer, [TensorSpec("float32", (1000,), 0)])
    members = tuple(GroupMember(bytes([i]) * 20, f"e{i}", 1.0) for i in range(2))
    group = Group(b"g" * 16, "k", 0, b"s" * 16, members, "none")
    plan = RoundPlan(group, 0, view, get_codec("none"), 1 << 16)
    exclusions = Counted()
    return OwnerLink(plan, Ledger(plan), 1, plan.by_owner[1], ReadyGate(1, 0.0),
                     exclusions), exclusions


def answer_all(link: OwnerLink) -> None:
    for p in link.parts:
        payload = link.plan.codec.encode(np.ones(p.numel, np.float32))
        dest = link.buffer_for(RESULT, p.index, len(payload), 0b11)
        assert dest is not None
        dest[:len(payload)] = payload
        link.on_frame(RESULT, p.index, dest[:len(payload)], 0b11)


@pytest.mark.parametrize("answered", [False, True])
def test_an_owner_that_left_is_counted_once_as_aborted(answered: bool) -> None:
    """Whether or not its results were all in: its parts will not come either."""
    link, exclusions = make_link()
    if answered:
        answer_all(link)
    link.on_frame(ABORT, 0, memoryview(b"the peer left the round"), LEFT)
    link.on_close(None)  # its stream closes behind the ABORT
    assert exclusions.calls == [("lost", 1, "aborted")]
    assert link.done.is_set() and (link.failure is None) == answered


def test_an_owner_that_refused_us_is_not_counted_as_gone() -> None:
    """An ABORT for another reason (it excluded us, our part was bad) says nothing of its own
    parts: they may still come on its stream to us."""
    for why, code in ((b"excluded: silent past the round's deadline", 0),
                      (b"part 0 holds NaN", BAD_VALUES)):
        link, exclusions = make_link()
        answer_all(link)
        link.on_frame(ABORT, 0, memoryview(why), code)
        link.on_close(None)
        assert exclusions.calls == [], why


def test_a_stream_dropped_without_a_word_is_counted_as_disconnected() -> None:
    link, exclusions = make_link()
    answer_all(link)
    link.on_close(ConnectionResetError())
    assert exclusions.calls == [("lost", 1, "disconnected")]
