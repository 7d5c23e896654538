"""What a matchmaking request is: the asking peer, its request, and what it knows of its line."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class MatchRequest:
    key: str
    schema_hash: bytes
    weight: float
    target_size: int = 16
    min_size: int = 2
    client_mode: bool = False
    attempt_seconds: float = 5.0
    # Peers known to be coming (grid line-mates). None: unknown, so assemble once everyone
    # declared under the key has joined and nothing changed for settle_seconds.
    expected: frozenset[bytes] | None = None
    codec: str = "none"
    # Without a grid, how long a complete-looking group must stay unchanged before it
    # assembles below its target; the node learns it from how late followers used to arrive.
    settle_seconds: float = 0.5


LONELY_GRACE = 0.2  # alone this long on our line: nobody is coming to this round


@dataclass(frozen=True)
class LineStatus:
    """What the run directory says about our grid line right now."""

    expected: frozenset[bytes]  # line-mates that will come to this round
    moved_on: bool  # some peer of the run already declared a later round
    settled: bool = True  # no peer joined or left the run lately: `expected` is complete
    # how long we must have been alone before giving up on the round: longer in a run's first
    # round here, when line-mates started at the same moment may not have declared yet
    grace: float = LONELY_GRACE


LineWatcher = Callable[[], Awaitable[LineStatus]]


@dataclass(frozen=True)
class Self:
    peer_id: bytes
    endpoint: str
    data_endpoint: str = ""
    bandwidth: float = 1.0


@dataclass
class SettlePolicy:
    """How long a leader below its target waits for latecomers once everyone declared has
    joined: twice the usual arrival spread of its followers, within [floor, ceiling]. After a
    peer leaves for good, later rounds then lose tens of milliseconds, not half a second."""

    floor: float = 0.05
    ceiling: float = 0.5
    spread: float = 0.25
    alpha: float = 0.3

    @property
    def seconds(self) -> float:
        return min(self.ceiling, max(self.floor, 2 * self.spread))

    def observe(self, spread: float) -> None:
        self.spread = (1 - self.alpha) * self.spread + self.alpha * max(spread, 0.0)
