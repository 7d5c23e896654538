"""Where the daemon reads the time: every protocol module asks here, never `time` itself.

A running daemon reads the system's clocks. A simulated swarm (moshpitd/virtual/) runs many
daemons in one process on a virtual event loop and gives each its own clock in a context
variable: `monotonic` follows the loop's virtual time, so deadlines compared with it agree with
the loop's timers, and `wall` adds the node's own offset, so clock skew between peers (signed
records dated by their writers) can be modelled. Tasks and callbacks inherit the context they
were created in, so a node's code reads its own clock wherever it runs.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def wall(self) -> float: ...


CLOCK: ContextVar[Clock | None] = ContextVar("moshpitd_clock", default=None)


def monotonic() -> float:
    """Seconds on a clock that never jumps: deadlines, timeouts, rates."""
    clock = CLOCK.get()
    return time.monotonic() if clock is None else clock.monotonic()


def wall() -> float:
    """Seconds since the epoch: what peers compare (record dates, expirations)."""
    clock = CLOCK.get()
    return time.time() if clock is None else clock.wall()


def wall_ns() -> int:
    """`wall` in integer nanoseconds, exact on the system clock: record versions."""
    clock = CLOCK.get()
    return time.time_ns() if clock is None else int(clock.wall() * 1e9)
