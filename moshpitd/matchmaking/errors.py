"""Matchmaking failures, each with a message a user can act on."""


class MatchmakingError(Exception):
    """No group could be formed."""


class GroupNotFound(MatchmakingError):
    """Not enough peers averaged under the key before the deadline."""


class NoPartners(GroupNotFound):
    """Nobody else is on this grid line this round: the peer keeps its value."""


class SchemaMismatch(MatchmakingError):
    """Peers under the key declared tensors of other dtypes or shapes."""


class DuplicateRequest(MatchmakingError):
    """This daemon already averages under the key."""
