"""FramedSocket over a unix socketpair: framing, limits, closed peers, SCM_RIGHTS descriptors."""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moshpitd.ipc.framing import (
    MAX_FDS,
    MAX_FRAME,
    ConnectionClosed,
    FramedSocket,
    ProtocolError,
    pack_frame,
)

TIMEOUT = 5.0


def _run(body: Callable[[FramedSocket, socket.socket], Awaitable[Any]]) -> Any:
    """Run body(framed end, raw peer end) in a fresh loop; both ends are closed afterwards."""

    async def main() -> Any:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        framed = FramedSocket(a)
        try:
            return await asyncio.wait_for(body(framed, b), TIMEOUT)
        finally:
            framed.close()
            b.close()

    return asyncio.run(main())


def _raw(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


def test_pack_frame_layout() -> None:
    obj = {"op": "hello", "n": 3, "blob": b"\x00\x01"}
    frame = pack_frame(obj)
    size = int.from_bytes(frame[:4], "big")
    assert size == len(frame) - 4
    assert msgpack.unpackb(frame[4:], raw=False) == obj


def test_read_one_frame() -> None:
    async def body(fs: FramedSocket, peer: socket.socket) -> None:
        peer.sendall(pack_frame({"op": "ping", "data": b"\xff" * 10, "x": [1, 2.5, None]}))
        assert await fs.read_frame() == {"op": "ping", "data": b"\xff" * 10, "x": [1, 2.5, None]}
        assert fs.take_fd() is None

    _run(body)


def test_several_frames_in_one_send_are_read_in_order() -> None:
    async def body(fs: FramedSocket, peer: socket.socket) -> None:
        peer.sendall(b"".join(pack_frame({"i": i}) for i in range(5)))
        assert [await fs.read_frame() for _ in range(5)] == [{"i": i} for i in range(5)]

    _run(body)


@settings(max_examples=40, deadline=None)
@given(
    objs=st.lists(
        st.dictionaries(
            st.text(max_size=8), st.binary(max_size=40) | st.integers(-(2**63), 2**63), max_size=4
        ),
        min_size=1, max_size=4,
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
)
def test_frames_split_across_sends(objs: list[dict[str, Any]], cuts: list[int]) -> None:
    data = b"".join(pack_frame(o) for o in objs)
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    chunks = [data[i:j] for i, j in itertools.pairwise(points)]

    async def body(fs: FramedSocket, peer: socket.socket) -> None:
        async def send() -> None:
            for chunk in chunks:
                peer.sendall(chunk)
                await asyncio.sleep(0)  # let the reader see a partial frame

        got, _ = await asyncio.gather(_sequential(fs, len(objs)), send())
        assert got == objs

    _run(body)


async def _sequential(fs: FramedSocket, n: int) -> list[dict[str, Any]]:
    return [await fs.read_frame() for _ in range(n)]


def test_byte_by_byte() -> None:
    data = pack_frame({"key": "value" * 20})

    async def body(fs: FramedSocket, peer: socket.socket) -> None:
        async def send() -> None:
            for i in range(len(data)):
                peer.sendall(data[i:i + 1])
                await asyncio.sleep(0)

        got, _ = await asyncio.gather(fs.read_frame(), send())
        assert got == {"key": "value" * 20}

    _run(body)


def test_large_frame_up_to_limit() -> None:
    blob = b"z" * (MAX_FRAME - 64)
    frame = pack_frame({"b": blob})
    assert len(frame) - 4 <= MAX_FRAME

    async def body(fs: FramedSocket, peer: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        peer.setblocking(False)
        got, _ = await asyncio.gather(fs.read_frame(), loop.sock_sendall(peer, frame))
        assert got == {"b": blob}

    _run(body)


def test_frame_over_limit_is_protocol_error() -> None:
    async def body(fs: FramedSocket, peer: socket.socket) -> None:
        peer.sendall((MAX_FRAME + 1).to_bytes(4, "big"))  # the length alone is enough
        with pytest.raises(ProtocolError):
            await fs.read_frame()

    _run(body)


@pytest.mark.parametrize(
    "payload",
    [
        msgpack.packb([1, 2, 3]),
        msgpack.packb("text"),
        msgpack.packb(7),
        msgpack.packb(None),
        msgpack.packb(b"bin"),
    ],
    ids=["list", "str", "int", "nil", "bin"],
)
def test_non_map_is_protocol_error(payload: bytes) -> None:
    async def body(fs: FramedSocket, peer: socket.socket) -> None:
        peer.sendall(_raw(payload))
        with pytest.raises(ProtocolError):
            await fs.read_frame()

    _run(body)


@pytest.mark.parametrize(
    "payload",
    [b"\xc1", b"", b"\x81\xa1a", msgpack.packb({1: "int key"}), msgpack.packb({"a": 1}) + b"\x00"],
    ids=["reserved-byte", "empty", "truncated-map", "int-key", "trailing-data"],
)
def test_undecodable_payload_is_protocol_error(payload: bytes) -> None:
    async def body(fs: FramedSocket, peer: socket.socket) -> None:
        peer.sendall(_raw(payload))
        with pytest.raises(ProtocolError):
            await fs.read_frame()

    _run(body)


def test_bad_frame_does_not_swallow_the_next_one() -> None:
    async def body(fs: FramedSocket, peer: socket.socket) -> None:
        peer.sendall(_raw(msgpack.packb([1])) + pack_frame({"ok": True}))
        with pytest.raises(ProtocolError):
            await fs.read_frame()
        assert await fs.read_frame() == {"ok": True}

    _run(body)


@pytest.mark.parametrize(
    "sent",
    [b"", b"\x00\x00", (100).to_bytes(4, "big"), (100).to_bytes(4, "big") + b"x" * 10,
     pack_frame({"a": 1})[:-1]],
    ids=["nothing", "half-length", "length-only", "partial-payload", "one-byte-short"],
)
def test_truncated_connection_is_connection_closed(sent: bytes) -> None:
    async def body(fs: FramedSocket, peer: socket.socket) -> None:
        peer.sendall(sent)
        peer.shutdown(socket.SHUT_WR)
        with pytest.raises(ConnectionClosed):
            await fs.read_frame()

    _run(body)


def test_close_after_complete_frame() -> None:
    async def body(fs: FramedSocket, peer: socket.socket) -> None:
        peer.sendall(pack_frame({"last": 1}))
        peer.close()
        assert await fs.read_frame() == {"last": 1}
        with pytest.raises(ConnectionClosed):
            await fs.read_frame()

    _run(body)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _same_file(a: int, b: int) -> bool:
    sa, sb = os.fstat(a), os.fstat(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def test_fd_passed_with_frame_is_queued() -> None:
    r, w = os.pipe()
    try:

        async def body(fs: FramedSocket, peer: socket.socket) -> None:
            socket.send_fds(peer, [pack_frame({"op": "buffer"})], [w])
            assert await fs.read_frame() == {"op": "buffer"}
            fd = fs.take_fd()
            assert fd is not None and fd not in (r, w)
            try:
                assert _same_file(fd, w)
                os.write(fd, b"through the passed fd")
                assert os.read(r, 100) == b"through the passed fd"
            finally:
                os.close(fd)
            assert fs.take_fd() is None

        _run(body)
    finally:
        os.close(r)
        os.close(w)


def test_several_fds_come_out_in_order() -> None:
    pipes = [os.pipe() for _ in range(3)]
    ends = [w for _, w in pipes]
    try:

        async def body(fs: FramedSocket, peer: socket.socket) -> None:
            socket.send_fds(peer, [pack_frame({"n": 2})], ends[:2])
            socket.send_fds(peer, [pack_frame({"n": 1})], ends[2:])
            assert await fs.read_frame() == {"n": 2}
            assert await fs.read_frame() == {"n": 1}
            got = [fs.take_fd() for _ in range(3)]
            try:
                assert all(fd is not None for fd in got)
                for fd, want in zip(got, ends, strict=True):
                    assert _same_file(fd, want)  # type: ignore[arg-type]
            finally:
                for fd in got:
                    if fd is not None:
                        os.close(fd)
            assert fs.take_fd() is None

        _run(body)
    finally:
        for r, w in pipes:
            os.close(r)
            os.close(w)


def test_too_many_fds_is_protocol_error_and_they_are_closed() -> None:
    r, w = os.pipe()
    try:

        async def body(fs: FramedSocket, peer: socket.socket) -> None:
            before = _open_fds()
            socket.send_fds(peer, [pack_frame({"op": "x"})], [w] * (MAX_FDS + 1))
            with pytest.raises(ProtocolError):
                await fs.read_frame()
            assert fs.take_fd() is None  # nothing left queued
            assert _open_fds() == before  # and nothing received was left open

        _run(body)
    finally:
        os.close(r)
        os.close(w)


def test_fds_accumulating_past_limit_is_protocol_error() -> None:
    r, w = os.pipe()
    try:

        async def body(fs: FramedSocket, peer: socket.socket) -> None:
            before = _open_fds()
            socket.send_fds(peer, [pack_frame({"i": 0})], [w] * MAX_FDS)
            assert await fs.read_frame() == {"i": 0}
            assert _open_fds() == before + MAX_FDS
            socket.send_fds(peer, [pack_frame({"i": 1})], [w])
            with pytest.raises(ProtocolError):
                await fs.read_frame()
            assert fs.take_fd() is None
            assert _open_fds() == before

        _run(body)
    finally:
        os.close(r)
        os.close(w)


def test_write_frame_reaches_peer() -> None:
    async def body(fs: FramedSocket, peer: socket.socket) -> None:
        await asyncio.gather(fs.write_frame({"a": 1}), fs.write_frame({"b": b"2"}))
        peer.setblocking(False)
        loop = asyncio.get_running_loop()
        data = b""
        want = len(pack_frame({"a": 1})) + len(pack_frame({"b": b"2"}))
        while len(data) < want:
            data += await loop.sock_recv(peer, 4096)
        frames = []
        while data:
            size = int.from_bytes(data[:4], "big")
            frames.append(msgpack.unpackb(data[4:4 + size], raw=False))
            data = data[4 + size:]
        assert sorted(frames, key=lambda f: sorted(f)) == [{"a": 1}, {"b": b"2"}]

    _run(body)


def test_write_then_read_between_two_framed_sockets() -> None:
    async def main() -> None:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fa, fb = FramedSocket(a), FramedSocket(b)
        try:
            await fa.write_frame({"req": 1})
            assert await asyncio.wait_for(fb.read_frame(), TIMEOUT) == {"req": 1}
            await fb.write_frame({"resp": [1, 2]})
            assert await asyncio.wait_for(fa.read_frame(), TIMEOUT) == {"resp": [1, 2]}
        finally:
            fa.close()
            fb.close()

    asyncio.run(main())
