"""The trainer's end of the socket when the daemon goes between two frames of one request."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

import moshpit
from moshpit.connection import DaemonConnection
from moshpitd.ipc import schema as wire
from moshpitd.ipc.errors import ErrorCode
from moshpitd.ipc.framing import pack_frame
from moshpitd.ipc.schema import error_frame


def test_a_refusal_read_before_the_goodbye_explains_a_closed_socket(tmp_path: Path) -> None:
    """A draining daemon refuses `average` (id 1), says goodbye (id nil) and closes before
    the trainer's `ready` goes out: the trainer learns the daemon is shutting down, not just
    that a pipe broke."""
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
            conn.sendall(pack_frame(error_frame(1, ErrorCode.SHUTTING_DOWN,
                                                "moshpitd is shutting down: no new rounds")))
            conn.sendall(pack_frame(error_frame(None, ErrorCode.SHUTTING_DOWN,
                                                "moshpitd is shutting down (SIGTERM)")))

    thread = threading.Thread(target=daemon)
    thread.start()
    conn = DaemonConnection(path, 5.0)
    try:
        rid = conn.send(wire.StatusRequest(), 5.0)
        assert got_request.wait(5)
        thread.join(5)
        assert not thread.is_alive()
        with pytest.raises(moshpit.DaemonShuttingDown, match="shutting down"):
            conn.send(wire.ReadyRequest(request=rid), 5.0)
    finally:
        conn.close()
        listener.close()


def test_a_stale_reply_nobody_awaits_is_not_taken_for_the_reason(tmp_path: Path) -> None:
    """A `ready` whose average was already refused gets an error reply nobody reads; when the
    socket is then found closed, the goodbye behind it is the reason raised."""
    path = str(tmp_path / "d.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def daemon() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(pack_frame(error_frame(1, ErrorCode.INVALID_REQUEST,
                                                "ready names no pending average")))
            conn.sendall(pack_frame(error_frame(None, ErrorCode.SHUTTING_DOWN,
                                                "moshpitd is shutting down (SIGTERM)")))

    thread = threading.Thread(target=daemon)
    thread.start()
    conn = DaemonConnection(path, 5.0)
    try:
        conn.send(wire.ReadyRequest(request=7), 5.0, awaited=False)
        thread.join(5)
        assert not thread.is_alive()
        with pytest.raises(moshpit.DaemonShuttingDown, match="SIGTERM"):
            conn.send(wire.StatusRequest(), 5.0)
    finally:
        conn.close()
        listener.close()
