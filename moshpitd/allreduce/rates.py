"""What a daemon's own rounds tell of its link: the rates it sends and receives at.

A round's wall time says little of one member's link: everyone waits for the slowest member,
so every member would learn the same rate, and spans sized from such rates would stay as they
were. Each data-plane connection instead times its own bytes, from the first to the last each
way. Connections to several peers run at once and share our link, so the sum of their rates is
what our side carried: a fast host's connection to another fast host is limited by our own
link, not by the slow peer it also talks to. Connections that moved little are mostly latency
and count for nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

MIN_TIMED_BYTES = 256 << 10  # a connection that moved less each way teaches no rate


class Timed(Protocol):
    @property
    def bytes_in(self) -> int: ...
    @property
    def bytes_out(self) -> int: ...
    @property
    def first_in(self) -> float: ...
    @property
    def last_in(self) -> float: ...
    @property
    def first_out(self) -> float: ...
    @property
    def last_out(self) -> float: ...


def link_rates(channels: Iterable[Timed]) -> tuple[float, float]:
    """(send, receive) in bytes/s over this round's connections; 0 where none taught one."""
    up = down = 0.0
    for ch in channels:
        if ch.bytes_out >= MIN_TIMED_BYTES and ch.last_out > ch.first_out:
            up += ch.bytes_out / (ch.last_out - ch.first_out)
        if ch.bytes_in >= MIN_TIMED_BYTES and ch.last_in > ch.first_in:
            down += ch.bytes_in / (ch.last_in - ch.first_in)
    return up, down
