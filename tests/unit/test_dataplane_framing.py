"""Data-plane framing (transport/dataplane.py Channel) under any split of the byte stream: a
data frame's read may carry the next frame's header along, and a control frame's never does
(its handler may hand the stream to another sink before the next frame is parsed)."""

from __future__ import annotations

import asyncio
import random

import pytest

from moshpitd.transport.dataplane import (
    ABORT,
    HEADER,
    HELLO,
    PART,
    RESULT,
    Channel,
    DataPlaneError,
)


class Recorder:
    """A sink that takes data frames into one reused buffer with room for a header."""

    def __init__(self, name: str, room: int = 1 << 16) -> None:
        self.name = name
        self.staging = memoryview(bytearray(room))
        self.frames: list[tuple[str, int, int, bytes, int]] = []
        self.closed = False

    def buffer_for(self, kind: int, part: int, length: int, aux: int) -> memoryview | None:
        if kind == ABORT:
            raise DataPlaneError("refused")
        return self.staging if kind in (PART, RESULT) else None

    def on_frame(self, kind: int, part: int, payload: memoryview, aux: int) -> None:
        self.frames.append((self.name, kind, part, bytes(payload), aux))

    def on_close(self, exc: BaseException | None) -> None:
        self.closed = True


def frame(kind: int, part: int, payload: bytes, aux: int = 0) -> bytes:
    return HEADER.pack(kind, 0, 0, part, len(payload), aux) + payload


def feed(channel: Channel, stream: bytes, rng: random.Random) -> None:
    """What the event loop does: fill what get_buffer offers, up to a random read size."""
    pos = 0
    while pos < len(stream):
        buf = channel.get_buffer(-1)
        assert len(buf) > 0
        n = min(len(buf), len(stream) - pos, rng.choice([1, 7, 24, 25, 100, 4096, 1 << 20]))
        buf[:n] = stream[pos:pos + n]
        pos += n
        channel.buffer_updated(n)


@pytest.mark.parametrize("seed", range(20))
def test_frames_survive_any_split(seed: int) -> None:
    rng = random.Random(seed)
    frames = []
    for i in range(40):
        kind = rng.choice([PART, RESULT, RESULT, HELLO])
        size = rng.choice([0, 1, 23, 24, 25, 1000] + ([5000] if kind != HELLO else []))
        frames.append((kind, i, rng.randbytes(size), rng.getrandbits(32)))

    async def scenario() -> list[tuple[str, int, int, bytes, int]]:
        sink = Recorder("a")
        channel = Channel(sink)
        feed(channel, b"".join(frame(*f) for f in frames), rng)
        return sink.frames

    got = asyncio.run(scenario())
    assert got == [("a", kind, part, payload, aux) for kind, part, payload, aux in frames]


def test_a_control_frame_reads_no_further_than_itself() -> None:
    """HELLO and a data frame behind it, all offered at once: the HELLO's handler pauses and
    hands the stream to another sink later (as the round registry does), so no byte of the
    next frame may have been read, let alone parsed for the handler, by then."""

    async def scenario() -> list[tuple[str, int, int, bytes, int]]:
        later = Recorder("round")
        first = Recorder("hello")
        channel = Channel(first)
        paused: list[bool] = []

        def hello(kind: int, part: int, payload: memoryview, aux: int) -> None:
            first.frames.append(("hello", kind, part, bytes(payload), aux))
            paused.append(True)  # the registry: pause_reading, attach the round in a task

        def only_hello(kind: int, part: int, length: int, aux: int) -> memoryview | None:
            if kind != HELLO:  # as the registry's handler: it knows no round's frames
                raise DataPlaneError("a stream must open with HELLO")
            return None

        first.on_frame = hello  # type: ignore[method-assign]
        first.buffer_for = only_hello  # type: ignore[method-assign]
        stream = frame(HELLO, 1, b"g" * 16) + frame(PART, 2, b"x" * 100) + frame(RESULT, 3, b"")
        pos = 0
        while pos < len(stream) and not channel.closed.done():
            if paused and channel.sink is first:
                channel.sink = later  # the round takes the stream; reading resumes
            buf = channel.get_buffer(-1)
            n = min(len(buf), len(stream) - pos)
            buf[:n] = stream[pos:pos + n]
            pos += n
            channel.buffer_updated(n)
        return first.frames + later.frames

    assert asyncio.run(scenario()) == [("hello", HELLO, 1, b"g" * 16, 0),
                                       ("round", PART, 2, b"x" * 100, 0),
                                       ("round", RESULT, 3, b"", 0)]


def test_a_refused_frame_after_a_coalesced_header_aborts_the_stream() -> None:
    async def scenario() -> tuple[list[tuple[str, int, int, bytes, int]], bool]:
        sink = Recorder("a")
        channel = Channel(sink)
        stream = frame(PART, 1, b"y" * 64) + frame(ABORT, 0, b"no") + frame(PART, 2, b"z")
        buf = channel.get_buffer(-1)  # the header, alone
        buf[:HEADER.size] = stream[:HEADER.size]
        channel.buffer_updated(HEADER.size)
        rest = stream[HEADER.size:]
        buf = channel.get_buffer(-1)  # the payload and room for the next header
        assert len(buf) == 64 + HEADER.size
        buf[:len(buf)] = rest[:len(buf)]
        channel.buffer_updated(len(buf))  # ABORT's header came along: refused at once
        return sink.frames, channel.closed.done()

    frames, closed = asyncio.run(scenario())
    assert frames == [("a", PART, 1, b"y" * 64, 0)]
    assert closed
