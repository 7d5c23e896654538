"""The trainer's end of the socket when the daemon goes between two frames of one request."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import moshpit
from moshpit.connection import DaemonConnection
from moshpitd.ipc import schema as wire
from moshpitd.ipc.errors import ErrorCode
from moshpitd.ipc.framing import pack_frame
from moshpitd.ipc.schema import error_frame

GOODBYE = error_frame(None, ErrorCode.SHUTTING_DOWN, "moshpitd is shutting down (SIGTERM)")


@contextmanager
def closing_daemon(tmp_path: Path, frames: list[dict[str, Any]]
                   ) -> Iterator[tuple[DaemonConnection, threading.Event, threading.Thread]]:
    """A daemon that reads the trainer's first request, writes `frames` and closes; the
    trainer's connection to it, the event set once the request was read, and its thread."""
    path = str(tmp_path / "d.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    got_request = threading.Event()

    def daemon() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(4096)
            got_request.set()
            for frame in frames:
                conn.sendall(pack_frame(frame))

    thread = threading.Thread(target=daemon)
    thread.start()
    conn = DaemonConnection(path, 5.0)
    try:
        yield conn, got_request, thread
    finally:
        conn.close()
        listener.close()


def test_a_refusal_read_before_the_goodbye_explains_a_closed_socket(tmp_path: Path) -> None:
    """A draining daemon refuses `average` (id 1), says goodbye (id nil) and closes before
    the trainer's `ready` goes out: the trainer learns the daemon is shutting down, not just
    that a pipe broke."""
    refusal = error_frame(1, ErrorCode.SHUTTING_DOWN, "moshpitd is shutting down: no new rounds")
    with closing_daemon(tmp_path, [refusal, GOODBYE]) as (conn, got_request, thread):
        rid = conn.send(wire.StatusRequest(), 5.0)
        assert got_request.wait(5)
        thread.join(5)
        assert not thread.is_alive()
        with pytest.raises(moshpit.DaemonShuttingDown, match="shutting down"):
            conn.send(wire.ReadyRequest(request=rid), 5.0)


def test_a_stale_reply_nobody_awaits_is_not_taken_for_the_reason(tmp_path: Path) -> None:
    """A `ready` whose average was already refused gets an error reply nobody reads; when the
    socket is then found closed, the goodbye behind it is the reason raised."""
    stale = error_frame(1, ErrorCode.INVALID_REQUEST, "ready names no pending average")
    with closing_daemon(tmp_path, [stale, GOODBYE]) as (conn, _, thread):
        conn.send(wire.ReadyRequest(request=7), 5.0, awaited=False)
        thread.join(5)
        assert not thread.is_alive()
        with pytest.raises(moshpit.DaemonShuttingDown, match="SIGTERM"):
            conn.send(wire.StatusRequest(), 5.0)
