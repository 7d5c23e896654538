"""The IPC contract against real daemons: the hello handshake refuses other protocol versions
on both sides, a timeout inside average is reported as the round's failure (never as missing
state), and malformed requests get errors naming op and field while the daemon goes on."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

import moshpit
from moshpitd.ipc.schema import IPC_PROTOCOL, ErrorCode
from moshpitd.launcher import LocalSwarm
from tests.integration.test_ipc_robustness import RawConn, check_daemons_still_average, frame


def wait_for_log(swarm: LocalSwarm, i: int, text: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = swarm.daemons[i].log_path.read_text(errors="replace")
        if text in log:
            return log
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in the log:\n{swarm.daemons[i].log_tail()}")


def test_a_client_of_another_protocol_is_refused_on_both_sides(
        swarm_factory: Callable[..., LocalSwarm], monkeypatch: pytest.MonkeyPatch) -> None:
    swarm = swarm_factory(2)
    monkeypatch.setattr("moshpit.connection.IPC_PROTOCOL", IPC_PROTOCOL + 1)
    with pytest.raises(moshpit.VersionMismatch) as exc:
        moshpit.Client(swarm.sockets[0])
    text = str(exc.value)
    assert text.startswith("version_mismatch: ")
    assert f"speaks IPC protocol {IPC_PROTOCOL}" in text and f"{IPC_PROTOCOL + 1}" in text
    log = wait_for_log(swarm, 0, "refused: this moshpitd")
    assert f"speaks {IPC_PROTOCOL + 1}" in log
    monkeypatch.undo()
    assert swarm.daemons[0].alive()
    check_daemons_still_average(swarm)


def test_an_unversioned_hello_learns_the_daemon_s_protocol_and_the_session_ends(
        swarm_factory: Callable[..., LocalSwarm]) -> None:
    swarm = swarm_factory(2)
    conn = RawConn(swarm.sockets[0], hello=False)
    try:
        conn.send(frame({"op": "hello", "id": 1}))  # a client of protocol 1 says no more
        reply = conn.reply()
        assert reply is not None and reply["ok"] is False, reply
        assert reply["error"] == ErrorCode.VERSION_MISMATCH and reply["id"] == 1
        assert reply["protocol"] == IPC_PROTOCOL
        assert "speaks 1" in reply["message"]
        assert conn.closed()
    finally:
        conn.close()
    wait_for_log(swarm, 0, "speaks 1: install matching versions")
    check_daemons_still_average(swarm)


def serve_like_an_unversioned_daemon(path: str, seen: list[dict[str, Any]]) -> socket.socket:
    """A peer on a real unix socket answering hello as the daemons before IPC_PROTOCOL did."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def answer() -> None:
        conn, _ = server.accept()
        with conn:
            size = int.from_bytes(conn.recv(4, socket.MSG_WAITALL), "big")
            request = msgpack.unpackb(conn.recv(size, socket.MSG_WAITALL), raw=False)
            seen.append(request)
            conn.sendall(frame({"ok": True, "id": request["id"], "peer_id": "ab" * 20,
                                "version": "0.0.9"}))
            conn.recv(1)  # until the client hangs up

    threading.Thread(target=answer, daemon=True).start()
    return server


def test_a_daemon_of_the_unversioned_protocol_is_refused_by_the_client(tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []
    path = str(tmp_path / "old.sock")
    server = serve_like_an_unversioned_daemon(path, seen)
    try:
        with pytest.raises(moshpit.VersionMismatch, match="unversioned IPC protocol 1.*speaks "
                           f"{IPC_PROTOCOL}: install matching versions"):
            moshpit.Client(path)
    finally:
        server.close()
    assert seen and seen[0]["op"] == "hello" and seen[0]["protocol"] == IPC_PROTOCOL


def test_a_timeout_during_average_is_the_round_s_failure_not_missing_state(
        swarm_factory: Callable[..., LocalSwarm]) -> None:
    swarm = swarm_factory(2)
    with moshpit.Client(swarm.sockets[0]) as client:
        started = time.monotonic()
        with pytest.raises(moshpit.GroupNotFound) as lonely:  # nobody else averages "alone"
            client.average([torch.ones(100)], key="alone", timeout=1.0, min_group_size=2)
        assert time.monotonic() - started < 1.0 + 5.0
        assert str(lonely.value).startswith(f"{ErrorCode.GROUP_NOT_FOUND}: ")
        # a grid run out of time after its first round (spent alone): the all-reduce failed
        with pytest.raises(moshpit.AllreduceFailed, match="timeout after 1 of 3 rounds") as late:
            client.average([torch.ones(100)], key="late-grid", timeout=1.0, grid=(2, 2),
                           rounds=3)
        for exc in (lonely.value, late.value):
            assert not isinstance(exc, moshpit.StateUnavailable), exc
        # the same daemon's state lookup running out of time is missing state
        with pytest.raises(moshpit.StateUnavailable):
            client.download_state("never-published", timeout=1.0)
        assert client.status()["status"]["rounds_failed"] >= 1
    assert swarm.daemons[0].alive()


def greeted(swarm: LocalSwarm) -> RawConn:
    return RawConn(swarm.sockets[0])


def refusal(conn: RawConn, request: dict[str, Any]) -> dict[str, Any]:
    conn.send(frame(request))
    reply = conn.reply()
    assert reply is not None and reply["ok"] is False, reply
    assert reply["id"] == request.get("id"), reply
    return reply


def test_malformed_requests_get_errors_naming_op_and_field(
        swarm_factory: Callable[..., LocalSwarm]) -> None:
    swarm = swarm_factory(2)
    fresh = RawConn(swarm.sockets[0], hello=False)
    try:
        early = refusal(fresh, {"op": "status", "id": 1})
        assert early["error"] == ErrorCode.PROTOCOL_ERROR
        assert "status before hello" in early["message"]
    finally:
        fresh.close()
    conn = greeted(swarm)
    try:
        cases: list[tuple[dict[str, Any], ErrorCode, str]] = [
            ({"op": "average", "id": 2, "tensors": []}, ErrorCode.INVALID_REQUEST,
             "average: field 'key' is missing"),
            ({"op": "average", "id": 3, "key": "k", "tensors": [], "colour": "red"},
             ErrorCode.INVALID_REQUEST, "average: field 'colour' is not a field of this op"),
            ({"op": "average", "id": 4, "key": "k", "tensors": [], "timeout": "soon"},
             ErrorCode.INVALID_REQUEST, "average: field 'timeout' has the wrong type (str"),
            ({"op": "state_info", "id": 5, "key": "k", "timeout": True},
             ErrorCode.INVALID_REQUEST, "state_info: field 'timeout' has the wrong type (bool"),
            ({"op": "status", "id": 6, "verbose": 1}, ErrorCode.INVALID_REQUEST,
             "status: field 'verbose' is not a field of this op"),
            ({"op": "attach", "id": 7, "size": 4096, "buffer": 64}, ErrorCode.INVALID_REQUEST,
             "attach: field 'buffer' must be in 0..63"),
            ({"op": "average", "id": 8, "key": "k", "tensors": [["float32", [4], 0]],
              "buffer": 5}, ErrorCode.INVALID_REQUEST,
             "average: field 'buffer' names no shared buffer 5"),
            ({"op": "average", "id": 9, "key": "k", "tensors": [["float32", "4", 0]]},
             ErrorCode.INVALID_REQUEST, "average: field 'tensors' is malformed"),
            ({"op": "average", "id": 10, "key": "k", "tensors": [], "codec": "gzip"},
             ErrorCode.INVALID_REQUEST, "average: field 'codec' is 'gzip', not one of"),
            ({"op": "jump", "id": 11}, ErrorCode.INVALID_REQUEST, "unknown op 'jump'"),
            ({"op": ["average"], "id": 12}, ErrorCode.INVALID_REQUEST,
             "request: field 'op' must be a string"),
        ]
        for request, code, message in cases:
            reply = refusal(conn, request)
            assert reply["error"] == code and reply["message"].startswith(message), reply
        # the session goes on: a well-formed request still works
        conn.send(frame({"op": "status", "id": 13}))
        status = conn.reply()
        assert status is not None and status["ok"] and status["id"] == 13, status
        assert set(status) == {"ok", "id", "status", "metrics", "ipc"}
    finally:
        conn.close()
    assert swarm.daemons[0].alive(), swarm.daemons[0].log_tail()
    assert "Traceback" not in swarm.daemons[0].log_path.read_text(errors="replace")
    check_daemons_still_average(swarm)
