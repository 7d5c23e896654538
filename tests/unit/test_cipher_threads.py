"""Large sealed frames are sealed and opened on cipher threads (transport/framecrypt.py
`off_loop`), over real loopback sockets: frames still arrive whole and in order, a control
frame queued while a large one is sealed follows it, a frame that arrived before its peer hung
up is delivered before the close, one altered on the way never reaches the sink, and a channel
counts as flushed only once a frame being sealed is written."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable

from moshpitd.transport.dataplane import FRAME_SLACK, HEADER, PART, READY, Channel
from moshpitd.transport.framecrypt import OFFLOAD_BYTES, TAG, FrameCipher, TamperedFrame

BIG = 4 * OFFLOAD_BYTES


class Sink:
    def __init__(self) -> None:
        self.staging = memoryview(bytearray(BIG + FRAME_SLACK))
        self.frames: list[tuple[int, int, bytes]] = []
        self.closed: asyncio.Future[BaseException | None] = \
            asyncio.get_running_loop().create_future()

    def buffer_for(self, kind: int, part: int, length: int, aux: int) -> memoryview | None:
        return self.staging if kind == PART else None

    def on_frame(self, kind: int, part: int, payload: memoryview, aux: int) -> None:
        assert not self.closed.done(), "a frame after the close"
        self.frames.append((kind, part, bytes(payload)))

    def on_close(self, exc: BaseException | None) -> None:
        self.closed.set_result(exc)


def payload(i: int) -> bytes:
    return bytes([i % 251]) * (BIG - i)


async def pair(keys: tuple[bytes, bytes]) -> tuple[Channel, Sink, asyncio.Server]:
    loop = asyncio.get_running_loop()
    sink = Sink()
    accepted: asyncio.Future[Channel] = loop.create_future()

    def accept() -> Channel:
        ch = Channel(sink, max_payload=BIG)
        ch.cipher = FrameCipher(keys[1], keys[0])
        accepted.set_result(ch)
        return ch

    server = await loop.create_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, sender = await loop.create_connection(lambda: Channel(None), "127.0.0.1", port)
    sender.cipher = FrameCipher(*keys)
    await accepted
    return sender, sink, server


def run(test: Callable[[], Awaitable[None]]) -> None:
    async def main() -> None:
        async with asyncio.timeout(20):
            await test()
    asyncio.run(main())


def test_large_frames_arrive_whole_and_in_order_and_a_control_frame_follows_its_turn() -> None:
    async def test() -> None:
        sender, sink, server = await pair((os.urandom(32), os.urandom(32)))
        sending = asyncio.ensure_future(sender.send(PART, 0, payload(0)))
        await asyncio.sleep(0)  # the frame is being sealed off the loop now
        assert sender._sealing and not sender.flushed()
        sender.send_nowait(READY, 7, b"after the part")  # its nonce comes after the part's
        await sending
        for i in range(1, 6):
            await sender.send(PART, i, payload(i)[:BIG // 2], payload(i)[BIG // 2:])
        while len(sink.frames) < 7:
            await asyncio.sleep(0.01)
        assert sink.frames[0] == (PART, 0, payload(0))
        assert sink.frames[1] == (READY, 7, b"after the part")
        assert sink.frames[2:] == [(PART, i, payload(i)) for i in range(1, 6)]
        sender.transport.close()  # type: ignore[union-attr]
        assert await sink.closed is None
        server.close()

    run(test)


def test_a_frame_in_before_the_peer_hung_up_is_delivered_before_the_close() -> None:
    async def test() -> None:
        sender, sink, server = await pair((os.urandom(32), os.urandom(32)))
        await sender.send(PART, 3, payload(3))
        sender.transport.close()  # type: ignore[union-attr]  # FIN right behind the frame
        await sink.closed
        assert sink.frames == [(PART, 3, payload(3))]
        server.close()

    run(test)


def test_an_altered_large_frame_never_reaches_the_sink() -> None:
    async def test() -> None:
        keys = (os.urandom(32), os.urandom(32))
        sender, sink, server = await pair(keys)
        cipher = FrameCipher(*keys)  # seals what the sender would, then a bit flips
        header = HEADER.pack(PART, 0, 0, 1, BIG + TAG, 0)
        sealed = bytearray(BIG + TAG)
        cipher.seal_into(header, [payload(0)], memoryview(sealed))
        sealed[BIG // 2] ^= 1
        sender.transport.write(header + bytes(sealed))  # type: ignore[union-attr]
        assert isinstance(await sink.closed, TamperedFrame)
        assert sink.frames == []
        server.close()

    run(test)
