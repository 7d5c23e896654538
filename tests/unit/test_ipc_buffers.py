"""A session's shared buffers: a buffer replaced by a new attach is unmapped as soon as no
request uses it, and a session never holds more than MAX_MAPPINGS mappings."""

from __future__ import annotations

import asyncio
import fcntl
import os
from types import SimpleNamespace

import pytest

from moshpitd.ipc.errors import IPCError
from moshpitd.ipc.schema import MAX_BUFFERS
from moshpitd.ipc.session import MAX_INFLIGHT, MAX_MAPPINGS, Session


class FakeConn:
    """Hands the session the memfd that came with its attach."""

    def __init__(self) -> None:
        self.fd: int | None = None

    def take_fd(self) -> int | None:
        fd, self.fd = self.fd, None
        return fd

    def close(self) -> None:
        pass


def attach(session: Session, conn: FakeConn, bid: int) -> None:
    fd = os.memfd_create("moshpit", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    conn.fd = fd
    session._attach({"size": 4096, "buffer": bid})


def test_replaced_buffers_go_once_unused_and_mappings_are_capped() -> None:
    async def main() -> None:
        conn = FakeConn()
        session = Session(SimpleNamespace(node=None), conn, 0)  # type: ignore[arg-type]
        attach(session, conn, 1)
        used = session.buffers[1]
        used.users += 1  # a request in flight works in it
        attach(session, conn, 1)
        attach(session, conn, 1)  # the one in between, used by nobody, goes at once
        assert session._retired == [used] and not used.mmap.closed
        session._release(used)  # the request is done
        assert session._retired == [] and used.mmap.closed
        for bid in range(MAX_BUFFERS):
            attach(session, conn, bid)
        for bid in range(MAX_INFLIGHT):  # as many requests as a session may have in flight
            session.buffers[bid].users += 1
            attach(session, conn, bid)
        assert len(session.buffers) + len(session._retired) == MAX_MAPPINGS
        session.buffers[MAX_INFLIGHT].users += 1
        with pytest.raises(IPCError, match=f"limit of {MAX_MAPPINGS}"):
            attach(session, conn, MAX_INFLIGHT)
        assert conn.fd is None  # the refused memfd was closed, not kept
        session._release(session._retired[0])  # a request ends: its buffer goes
        attach(session, conn, MAX_INFLIGHT)
        # a view that outlives its request keeps the mapping until it is gone
        view = session.buffers[20].view()
        attach(session, conn, 20)
        lingering = session._retired[-1]
        assert not lingering.users and not lingering.mmap.closed
        view.release()
        attach(session, conn, 21)
        assert lingering.mmap.closed and lingering not in session._retired
        held = [*session.buffers.values(), *session._retired]
        await session.close()
        assert len(held) == MAX_MAPPINGS and all(b.mmap.closed for b in held)

    asyncio.run(main())
