"""What a matchmaking request is: the asking peer, its request, and what it knows of its line."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from moshpitd.allreduce.rates import PeerRates
from moshpitd.matchmaking.liveness import Liveness
from moshpitd.matchmaking.shunned import Shunned
from moshpitd.matchmaking.signing import PeerAuth


@dataclass(frozen=True)
class MatchRequest:
    key: str
    schema_hash: bytes
    weight: float
    target_size: int = 16
    min_size: int = 2
    client_mode: bool = False
    # One attempt: the round clock's (RoundClock.attempt), never a default of its own.
    attempt_seconds: float = field(kw_only=True)
    # The setting matchmaking_attempt_timeout, uncut by the request: an honest peer's
    # declaration lives one attempt, so one that ends more than two of ours after our own is
    # not followed or waited for (0: take attempt_seconds).
    longest_attempt: float = 0.0
    # Peers known to be coming (grid line-mates). None: unknown, so assemble once everyone
    # declared under the key has joined and nothing changed for settle_seconds.
    expected: frozenset[bytes] | None = None
    codec: str = "none"
    # Without a grid, how long a complete-looking group must stay unchanged before it
    # assembles below its target: learnt by the node's SettlePolicy.
    settle_seconds: float = field(kw_only=True)
    # a shard host's rank digests (declaration.rank_digests): its mismatches name a rank
    rank_digests: bytes = b""
    # Without a grid: our last group's other members under this key (peer id -> endpoint).
    # A leader below its target waits a moment (assembly.PARTNER_WAIT) for those not here
    # yet that answer a probe: one that is a few polls late would otherwise miss the round
    # and wait out its whole timeout alone.
    partners: Mapping[bytes, str] = field(default_factory=dict)


# Alone this long on our line: nobody is coming to this round. A protocol constant: it covers a
# line-mate's step from one round to the next (a run-directory write and a DHT declaration,
# tens of ms), which does not grow with the attempt or the data. A daemon's first round of a
# run waits longer (runs.FIRST_GRACE).
LONELY_GRACE = 0.2  # s


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
    auth: PeerAuth | None = None  # signs our joins and groups; a leader without one takes none
    # leaders this daemon no longer asks, over all its requests
    shunned: Shunned = field(default_factory=Shunned)
    # owners whose span failed its check (allreduce/verifier.py): never grouped with again
    liars: Shunned = field(default_factory=Shunned)
    # who answered our probes lately, over all requests (None: follow any declared peer)
    liveness: Liveness | None = None
    # what each peer's streams carried to us lately: a group we lead caps declared rates by it
    rates: PeerRates | None = None


# The settle time's bounds. It is learnt (SettlePolicy), but within these, which are latencies
# of DHT polls, not of the data: below the floor, a latecomer that declared a couple of polls
# (the matchmaker's MIN_POLL) after the others could not be seen in time; the ceiling, one
# MAX_POLL, bounds what a complete group loses to a peer that never comes, and is the start
# value until a round teaches one.
SETTLE_FLOOR = 0.05  # s
SETTLE_CEILING = 0.5  # s
SPREAD_ALPHA = 0.3  # weight of the newest round in the moving average, as DeadlinePolicy's


@dataclass
class SettlePolicy:
    """How long a leader below its target waits for latecomers once everyone declared has
    joined: twice the usual arrival spread of its followers, within [floor, ceiling]. After a
    peer leaves for good, later rounds then lose tens of milliseconds, not half a second."""

    floor: float = SETTLE_FLOOR
    ceiling: float = SETTLE_CEILING
    spread: float = SETTLE_CEILING / 2  # starts at the ceiling
    alpha: float = SPREAD_ALPHA

    @property
    def seconds(self) -> float:
        return min(self.ceiling, max(self.floor, 2 * self.spread))

    def observe(self, spread: float) -> None:
        self.spread = (1 - self.alpha) * self.spread + self.alpha * max(spread, 0.0)
