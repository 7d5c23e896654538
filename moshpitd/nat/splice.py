"""Two TCP connections joined end to end: what one side sends, the other's peer receives.

A relay joins a caller's connection to the one its private peer opened for it. Bytes are
copied as they come (no framing, no buffering past the transports' own), each direction
paused while the other side's send buffer is full, and both charged to one byte bucket per
reservation, so a relayed peer costs its relay at most the rate the operator allows.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from moshpitd.buckets import Bucket

HIGH_WATER = 256 << 10  # bytes queued towards one side before the other is read no more


class Budget:
    """What one reservation may move: a byte bucket, and a count for /metrics."""

    def __init__(self, rate: float, clock: Callable[[], float], count: Callable[[int], None]
                 ) -> None:
        self.clock = clock
        self.bucket = Bucket(rate, max(rate, HIGH_WATER), clock()) if rate > 0 else None
        self.count = count

    def charge(self, n: int) -> float:
        self.count(n)
        return 0.0 if self.bucket is None else self.bucket.charge(n, self.clock())


class Half(asyncio.Protocol):
    """One end of a splice. `tamper` is the fault tests' hook into what passes."""

    def __init__(self, budget: Budget, on_close: Callable[[], None] = lambda: None,
                 tamper: Callable[[bytes], bytes] | None = None,
                 on_made: Callable[[Half], None] = lambda half: None) -> None:
        self.budget = budget
        self.on_close = on_close
        self.on_made = on_made
        self.origin = ""  # a caller's address (the relay's bound per caller)
        self.serial = 0  # a caller's number in its reservation
        self.tamper = tamper
        self.transport: asyncio.Transport | None = None
        self.other: Half | None = None
        self._held: set[str] = set()  # why reading is paused: "rate", "pressure"
        self._eof = False
        self._early: list[bytes] = []  # read before the other end exists (a loop may read
        # before a pause asked for in connection_made takes hold)

    def join(self, other: Half) -> None:
        self.other, other.other = other, self
        for half in (self, other):
            assert half.transport is not None
            half.transport.set_write_buffer_limits(high=HIGH_WATER)
        for half in (self, other):
            early, half._early = half._early, []
            for data in early:
                half.data_received(data)
            half._release("joining")

    def hold(self, why: str) -> None:
        if not self._held and self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()
        self._held.add(why)

    def _release(self, why: str) -> None:
        self._held.discard(why)
        if not self._held and self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.hold("joining")  # until the other end exists
        self.on_made(self)

    def data_received(self, data: bytes) -> None:
        other = self.other
        if other is None:
            self._early.append(data)
            if self.transport is not None:
                self.transport.pause_reading()  # again: now it holds on every loop
            if sum(map(len, self._early)) > HIGH_WATER:
                self.close()
            return
        if other.transport is None or other.transport.is_closing():
            return
        if self.tamper is not None:
            data = self.tamper(data)
        other.transport.write(data)
        wait = self.budget.charge(len(data))
        if wait > 0:
            self.hold("rate")
            asyncio.get_running_loop().call_later(wait, self._release, "rate")

    def eof_received(self) -> bool:
        self._eof = True
        other = self.other
        if other is None or other.transport is None or other._eof:
            if other is not None and other.transport is not None:
                other.transport.close()  # both ends said all they had: done
            return False
        if other.transport.can_write_eof():
            other.transport.write_eof()
            return True  # half-closed: the other direction may still flow
        return False

    def pause_writing(self) -> None:  # our peer takes bytes slower than the other end sends
        if self.other is not None:
            self.other.hold("pressure")

    def resume_writing(self) -> None:
        if self.other is not None:
            self.other._release("pressure")

    def connection_lost(self, exc: BaseException | None) -> None:
        other, self.other = self.other, None
        if other is not None and other.transport is not None:
            other.other = None
            if exc is None and self._eof:
                other.transport.close()  # what it still has to send goes out first
            else:
                other.transport.abort()
        self.on_close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()
