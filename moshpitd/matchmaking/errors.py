"""Matchmaking failures, each with a message a user can act on."""

from typing import Any


class MatchmakingError(Exception):
    """No group could be formed."""


class GroupNotFound(MatchmakingError):
    """Not enough peers averaged under the key before the deadline."""

    record: Any = None  # the daemon's RoundRecord of the round that found nobody


class NoPartners(GroupNotFound):
    """Nobody else is on this grid line this round: the peer keeps its value."""


class SchemaMismatch(MatchmakingError):
    """Peers under the key declared tensors of other dtypes or shapes."""


class DuplicateRequest(MatchmakingError):
    """This daemon already averages under the key."""
