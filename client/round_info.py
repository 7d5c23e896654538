"""What the daemon reports about a round, as the trainer sees it."""

from __future__ import annotations

from dataclasses import dataclass

from moshpit.errors import ProtocolError
from moshpitd.ipc import schema as wire


@dataclass(frozen=True)
class RoundInfo:
    """What the daemon reports about the last averaging round."""

    group_size: int
    seconds: float
    matchmaking_seconds: float
    bytes_sent: int
    bytes_received: int
    round: int | None = None  # the grid round (None without a grid)
    coords: tuple[int, ...] | None = None  # this peer's cell on the grid
    group_sizes: tuple[int, ...] = ()  # one per round of a multi-round call
    # What each element of the result is, for the last all-reduce: (start, stop, members) over
    # the flattened tensors in request order; `members` is a bitmask of the group members whose
    # values were averaged there, 0 where the element kept its local value (a peer failed).
    spans: tuple[tuple[int, int, int], ...] = ()
    members: tuple[str, ...] = ()  # peer ids of the group, bit i of a mask = members[i]
    owned: int = 0  # elements this peer reduced for its group (0 in client mode)
    # With local_world: this trainer's local rank (a replica's is its order of arrival in the
    # round) and the local ranks whose values the host sent (replicas left out are missing)
    local_rank: int | None = None
    local_ranks: tuple[int, ...] = ()

    @property
    def fully_averaged(self) -> bool:
        return all(mask for _, _, mask in self.spans)


def round_info(reply: wire.AverageReply) -> RoundInfo:
    if any(len(span) != 3 for span in reply.spans):
        raise ProtocolError("average: field 'spans' holds a span that is not [start, stop, "
                            "mask]")
    return RoundInfo(
        group_size=reply.group_size, seconds=reply.seconds,
        matchmaking_seconds=reply.matchmaking_seconds, bytes_sent=reply.bytes_sent,
        bytes_received=reply.bytes_received, round=reply.round,
        coords=None if reply.coords is None else tuple(reply.coords),
        group_sizes=tuple(reply.group_sizes),
        spans=tuple((a, b, m) for a, b, m in reply.spans),
        members=tuple(reply.members), owned=reply.owned, local_rank=reply.local_rank,
        local_ranks=tuple(reply.local_ranks))
