"""Matchmaking failures, each with a message a user can act on."""

from collections.abc import Mapping

from moshpitd.matchmaking.declaration import first_differing_rank


class MatchmakingError(Exception):
    """No group could be formed."""


class GroupNotFound(MatchmakingError):
    """Not enough peers averaged under the key before the deadline."""


class NoPartners(GroupNotFound):
    """Nobody else is on this grid line this round: the peer keeps its value."""


class SchemaMismatch(MatchmakingError):
    """Peers under the key declared tensors of other dtypes or shapes. A shard host's names
    its first local rank whose tensors differ from that rank's at a peer that declared its
    ranks too (`rank`, carried by the IPC error reply)."""

    def __init__(self, message: str, ours: bytes = b"",
                 theirs: Mapping[bytes, bytes] | None = None) -> None:
        found = sorted((rank, peer) for peer, ranks in (theirs or {}).items()
                       if (rank := first_differing_rank(ours, ranks)) is not None)
        self.rank = found[0][0] if found else None
        if found:
            message = (f"local rank {self.rank} of this host holds other tensors than local "
                       f"rank {self.rank} of peer {found[0][1].hex()[:8]} (a host's vector is "
                       f"its shard ranks' tensors in rank order): {message}")
        super().__init__(message)
        self.extra = {} if self.rank is None else {"rank": self.rank}


class DuplicateRequest(MatchmakingError):
    """This daemon already averages under the key."""
