"""IPC server: the trainers' unix socket; one Session (moshpitd/ipc/session.py) per connection."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import stat

from moshpitd.ipc.framing import FramedSocket
from moshpitd.ipc.schema import ErrorCode, error_frame
from moshpitd.ipc.session import Session
from moshpitd.node import MoshpitNode

log = logging.getLogger(__name__)

MAX_SESSIONS = 64
# Protocol constants: neither comes from a request or a round (no round is involved).
# s the accept loop waits when the process is out of descriptors: long enough for sessions
# to close and free some, short against a trainer's connect timeout (5 s by default)
ACCEPT_RETRY = 0.1
# s a goodbye frame may take to reach one trainer during a drain: a frame of ~100 bytes into
# a unix socket takes microseconds unless the trainer stopped reading and its buffer is full;
# such a trainer must not hold up the drain of the others
GOODBYE_TIMEOUT = 1.0


class IPCServer:
    def __init__(self, node: MoshpitNode, path: str, metrics_endpoint: str = "",
                 max_sessions: int = MAX_SESSIONS) -> None:
        self.node = node
        self.max_sessions = max_sessions
        self.path = path
        self.metrics_endpoint = metrics_endpoint
        self.sock: socket.socket | None = None
        self.sessions: set[asyncio.Task[None]] = set()
        self._accept_task: asyncio.Task[None] | None = None
        self._count = 0
        self.draining = False
        self.live: set[Session] = set()

    async def start(self) -> None:
        _remove_stale_socket(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.path)
        os.chmod(self.path, 0o660)
        sock.listen(64)
        sock.setblocking(False)
        self.sock = sock
        self._accept_task = asyncio.create_task(self._accept_loop())

    async def _accept_loop(self) -> None:
        assert self.sock is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self.sock)
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    log.warning("ipc accept: %s; retrying", exc)
                    await asyncio.sleep(ACCEPT_RETRY)
                    continue
                raise
            if len(self.sessions) >= self.max_sessions:
                framed = FramedSocket(conn)
                with contextlib.suppress(OSError):
                    await framed.write_frame(error_frame(
                        None, ErrorCode.TOO_MANY_SESSIONS, f"at most {self.max_sessions} "
                        "trainer sessions at once (max_ipc_sessions)"))
                framed.close()
                continue
            self._count += 1
            session = Session(self, FramedSocket(conn), self._count)
            self.live.add(session)
            task = asyncio.create_task(self._run_session(session))
            self.sessions.add(task)
            task.add_done_callback(self.sessions.discard)

    async def _run_session(self, session: Session) -> None:
        self.node.metrics.ipc_sessions.inc()
        try:
            await session.run()
        except Exception:
            log.exception("ipc session %d failed", session.number)
        finally:
            self.live.discard(session)
            self.node.metrics.ipc_sessions.dec()

    def begin_drain(self) -> None:
        """No new trainers (the socket path goes away) and no new rounds from attached ones."""
        self.draining = True
        if self._accept_task is not None:
            self._accept_task.cancel()
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    async def say_goodbye(self) -> None:
        """Tell every attached trainer why the daemon goes: the frame (id nil) answers its
        next request, so it raises a clear error instead of finding a dead socket."""
        goodbye = error_frame(None, ErrorCode.SHUTTING_DOWN,
                              "moshpitd is shutting down (SIGTERM); reconnect when it is back")
        async def tell(session: Session) -> None:
            with contextlib.suppress(OSError, TimeoutError):
                async with asyncio.timeout(GOODBYE_TIMEOUT):
                    await session.conn.write_frame(goodbye)
        await asyncio.gather(*(tell(s) for s in list(self.live)))

    async def stop(self) -> None:
        if self._accept_task is not None:
            self._accept_task.cancel()
            await asyncio.gather(self._accept_task, return_exceptions=True)
        for task in list(self.sessions):
            task.cancel()
        await asyncio.gather(*self.sessions, return_exceptions=True)
        if self.sock is not None:
            self.sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def _remove_stale_socket(path: str) -> None:
    """Reuse the path of a dead daemon's socket, never of a live one."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)
        return
    finally:
        probe.close()
    raise OSError(f"another daemon is listening on {path}")
