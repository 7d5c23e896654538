"""A trainer's memfd, mapped into the daemon, where tensors are averaged in place."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import mmap
import os
import stat
from collections.abc import Iterable

from moshpitd import timebase


class BufferError_(ValueError):
    """The descriptor is not a usable shared buffer."""


REQUIRED_SEALS = fcntl.F_SEAL_SHRINK
# A finished round's objects hold views of the trainer's buffer in reference cycles until the
# garbage collector runs, and a mapping with views cannot be closed. A failed close runs a
# collection, at most one per COLLECT_EVERY (a trainer must not make the daemon collect without
# pause).
COLLECT_EVERY = 1.0  # s
_last_collect = -COLLECT_EVERY


class SharedBuffer:
    """Owns one mapping. The memfd must be sealed against shrinking: a trainer that truncated a
    mapped file would otherwise kill the daemon with SIGBUS."""

    def __init__(self, fd: int, size: int, max_size: int) -> None:
        try:
            if not 0 < size <= max_size:
                raise BufferError_(f"buffer size {size} is outside 1..{max_size} bytes")
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise BufferError_("the descriptor is not a memfd (not a regular file)")
            target = os.readlink(f"/proc/self/fd/{fd}")
            if not target.startswith("/memfd:"):
                raise BufferError_(f"the descriptor is not a memfd ({target!r})")
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError as exc:
                raise BufferError_("the memfd does not allow sealing") from exc
            if seals & REQUIRED_SEALS != REQUIRED_SEALS:
                raise BufferError_("the memfd must be sealed with F_SEAL_SHRINK")
            if st.st_size < size:
                raise BufferError_(f"the memfd holds {st.st_size} bytes, fewer than the "
                                   f"declared {size}")
            self.mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.size = size
        self.users = 0  # requests in flight that use it (ipc/session.py)

    def view(self) -> memoryview:
        return memoryview(self.mmap)

    def close(self) -> bool:
        """Unmaps it; False if views of it are still alive (the mapping then stays until they
        are gone and close is called again)."""
        with contextlib.suppress(BufferError):
            self.mmap.close()
        return bool(self.mmap.closed)


def unmap(buffers: Iterable[SharedBuffer]) -> list[SharedBuffer]:
    """Closes the buffers; returns those still mapped (views of them still alive)."""
    global _last_collect
    left = [b for b in buffers if not b.close()]
    if left and timebase.monotonic() - _last_collect >= COLLECT_EVERY:
        _last_collect = timebase.monotonic()
        gc.collect()
        left = [b for b in left if not b.close()]
    return left
