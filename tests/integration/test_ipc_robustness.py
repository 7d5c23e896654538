"""Malformed IPC input and dying trainers must not hurt the daemon or its other clients."""

from __future__ import annotations

import array
import fcntl
import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import torch

import moshpit
from moshpitd.ipc.schema import IPC_PROTOCOL
from moshpitd.launcher import LocalSwarm
from tests.integration.helpers import active_keys, run_parallel, wait_until


def frame(obj: Any) -> bytes:
    payload = msgpack.packb(obj, use_bin_type=True)
    return len(payload).to_bytes(4, "big") + payload


class RawConn:
    """A trainer speaking raw frames, after the hello every session starts with."""

    def __init__(self, path: str, hello: bool = True) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(path)
        if hello:
            self.send(frame({"op": "hello", "id": 0, "protocol": IPC_PROTOCOL}))
            reply = self.reply()
            assert reply is not None and reply["ok"] and reply["protocol"] == IPC_PROTOCOL

    def send(self, data: bytes, fd: int | None = None) -> None:
        if fd is None:
            self.sock.sendall(data)
        else:
            self.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                        array.array("i", [fd]))])

    def reply(self) -> dict[str, Any] | None:
        """The next reply, or None if the daemon closed the connection."""
        head = self._exact(4)
        if head is None:
            return None
        body = self._exact(int.from_bytes(head, "big"))
        assert body is not None
        obj = msgpack.unpackb(body, raw=False)
        assert isinstance(obj, dict)
        return obj

    def closed(self) -> bool:
        return self._exact(1) is None

    def _exact(self, n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            try:
                chunk = self.sock.recv(n - len(buf))
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            buf += chunk
        return buf

    def close(self) -> None:
        self.sock.close()


def sealed_memfd(size: int, seal: bool = True) -> int:
    fd = os.memfd_create("test", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd


def assert_error_then_usable(conn: RawConn, substring: str) -> None:
    reply = conn.reply()
    assert reply is not None and reply["ok"] is False, reply
    assert substring in reply["message"], reply
    conn.send(frame({"op": "hello", "id": 99, "protocol": IPC_PROTOCOL}))
    hello = conn.reply()
    assert hello is not None and hello["ok"] and hello["id"] == 99


def assert_error_or_closed(conn: RawConn) -> None:
    reply = conn.reply()
    if reply is not None:
        assert reply["ok"] is False, reply
        assert conn.closed()


def check_daemons_still_average(swarm: LocalSwarm) -> None:
    clients = [moshpit.Client(s) for s in swarm.sockets[:2]]
    inputs = [torch.full((1000,), 1.0), torch.full((1000,), 3.0)]
    results = run_parallel([lambda i=i: clients[i].average([inputs[i]], key="after", timeout=20)
                            for i in range(2)])
    for r in results:
        assert not isinstance(r, Exception), r
        assert torch.allclose(r[0], torch.full((1000,), 2.0))
    for c in clients:
        c.close()


CASES: dict[str, Callable[[RawConn, str], None]] = {}


def case(fn: Callable[[RawConn, str], None]) -> Callable[[RawConn, str], None]:
    CASES[fn.__name__] = fn
    return fn


@case
def garbage_bytes(conn: RawConn, tmp: str) -> None:
    conn.send(b"\x00\x00\x00\x08\xc1\xc1\xc1\xc1garbage!")
    assert_error_or_closed(conn)


@case
def truncated_msgpack_in_frame(conn: RawConn, tmp: str) -> None:
    conn.send(b"\x00\x00\x00\x04\x82\xa2op\xa5")
    assert_error_or_closed(conn)


@case
def truncated_frame_then_hangup(conn: RawConn, tmp: str) -> None:
    conn.send(b"\x00\x00\x01\x00" + b"\x81" * 10)
    conn.close()


@case
def huge_length_prefix(conn: RawConn, tmp: str) -> None:
    conn.send((6 << 30).to_bytes(8, "big")[-4:] if False else b"\xff\xff\xff\xf0" + b"x" * 64)
    assert_error_or_closed(conn)


@case
def not_a_map(conn: RawConn, tmp: str) -> None:
    conn.send(frame([1, 2, 3]))
    assert_error_or_closed(conn)


@case
def wrong_field_types(conn: RawConn, tmp: str) -> None:
    conn.send(frame({"op": "average", "key": 5, "tensors": "x"}))
    assert_error_then_usable(conn, "key")
    conn.send(frame({"op": 7}))
    assert_error_then_usable(conn, "op")
    conn.send(frame({"op": "average", "key": "k", "tensors": [["float32", "3", 0]]}))
    assert_error_then_usable(conn, "")
    conn.send(frame({"op": "attach", "size": "big"}))
    assert_error_then_usable(conn, "size")
    conn.send(frame({"op": "fly"}))
    assert_error_then_usable(conn, "unknown op")


@case
def average_before_attach(conn: RawConn, tmp: str) -> None:
    conn.send(frame({"op": "average", "key": "k", "tensors": [["float32", [4], 0]]}))
    assert_error_then_usable(conn, "no shared buffer")


@case
def attach_without_fd(conn: RawConn, tmp: str) -> None:
    conn.send(frame({"op": "attach", "size": 4096}))
    assert_error_then_usable(conn, "memfd")


@case
def fd_of_regular_file(conn: RawConn, tmp: str) -> None:
    path = os.path.join(tmp, "plain.bin")
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    fd = os.open(path, os.O_RDWR)
    try:
        conn.send(frame({"op": "attach", "size": 4096}), fd)
    finally:
        os.close(fd)
    assert_error_then_usable(conn, "not a memfd")


@case
def fd_of_pipe(conn: RawConn, tmp: str) -> None:
    r, w = os.pipe()
    try:
        conn.send(frame({"op": "attach", "size": 4096}), r)
    finally:
        os.close(r)
        os.close(w)
    assert_error_then_usable(conn, "not a memfd")


@case
def unsealed_memfd(conn: RawConn, tmp: str) -> None:
    fd = sealed_memfd(4096, seal=False)
    try:
        conn.send(frame({"op": "attach", "size": 4096}), fd)
    finally:
        os.close(fd)
    assert_error_then_usable(conn, "F_SEAL_SHRINK")


@case
def memfd_smaller_than_declared(conn: RawConn, tmp: str) -> None:
    fd = sealed_memfd(4096)
    try:
        conn.send(frame({"op": "attach", "size": 1 << 20}), fd)
    finally:
        os.close(fd)
    assert_error_then_usable(conn, "fewer than")


@case
def buffer_too_small_for_tensors(conn: RawConn, tmp: str) -> None:
    fd = sealed_memfd(4096)
    try:
        conn.send(frame({"op": "attach", "size": 4096, "id": 1}), fd)
    finally:
        os.close(fd)
    ok = conn.reply()
    assert ok is not None and ok["ok"], ok
    conn.send(frame({"op": "average", "key": "k", "tensors": [["float32", [10000], 0]],
                     "timeout": 5}))
    assert_error_then_usable(conn, "outside the shared buffer")
    conn.send(frame({"op": "average", "key": "k", "tensors": [["float32", [4], 2]],
                     "timeout": 5}))
    assert_error_then_usable(conn, "aligned")
    conn.send(frame({"op": "average", "key": "k", "tensors": [["int64", [4], 0]],
                     "timeout": 5}))
    assert_error_then_usable(conn, "not supported")


@pytest.mark.parametrize("name", sorted(CASES))
def test_malformed_ipc_input(swarm_factory: Callable[..., LocalSwarm], name: str,
                             tmp_path: Any) -> None:
    swarm = swarm_factory(2)
    conn = RawConn(swarm.sockets[0])
    try:
        CASES[name](conn, str(tmp_path))
    finally:
        conn.close()
    assert swarm.daemons[0].alive(), swarm.daemons[0].log_tail()
    check_daemons_still_average(swarm)


TRAINER = textwrap.dedent("""
    import sys, torch, moshpit
    c = moshpit.Client(sys.argv[1])
    print("connected", flush=True)
    try:
        c.average([torch.ones(int(sys.argv[3]))], key=sys.argv[2], timeout=20, group_size=2)
        print("done", flush=True)
    except moshpit.MoshpitError as exc:
        print("error", type(exc).__name__, exc, flush=True)
""")


def start_trainer(socket_path: str, key: str, elems: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, socket_path, key, str(elems)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "connected"
    return proc


def test_trainer_killed_during_matchmaking(swarm_factory: Callable[..., LocalSwarm]) -> None:
    """The kill lands while the daemon reports the request matchmaking (its trainer waits for
    a partner that never comes, up to 20 s); the daemon then drops the request at once, long
    before its timeout, and takes a new one under the same key."""
    swarm = swarm_factory(2)
    watch = moshpit.Client(swarm.sockets[0])
    proc = start_trainer(swarm.sockets[0], "lonely", 1000)
    wait_until(lambda: "lonely" in active_keys(watch), 10, "the request matchmaking")
    assert proc.poll() is None, "the trainer's request ended before the kill"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.stdout is not None and proc.stdout.read() == "", "its request had ended"
    wait_until(lambda: "lonely" not in active_keys(watch), 5,
               "the daemon dropping the dead trainer's request")
    assert swarm.daemons[0].alive()
    # the key is free again: a new request under it is not refused as a duplicate
    clients = [moshpit.Client(s) for s in swarm.sockets]
    results = run_parallel([lambda c=c: c.average([torch.ones(10)], key="lonely", timeout=20)
                            for c in clients])
    assert all(not isinstance(r, Exception) for r in results), results
    assert clients[0].status()["status"]["rounds_done"] == 1
