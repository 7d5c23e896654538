"""How a local group refuses or fails its trainers: each error is an IPC code of its own,
and names the local rank at fault (the error reply carries it as `rank`)."""

from __future__ import annotations

from moshpitd.ipc.errors import ErrorCode, IPCError


class LocalRankMissing(IPCError):
    """A shard rank left or never came: the host's vector is incomplete, so every rank of the
    host fails and nothing is sent."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(ErrorCode.LOCAL_RANK_MISSING, message, rank=rank)
        self.rank = rank


class LocalMismatch(IPCError):
    """A local trainer disagrees with the first of its group (local_world, the mode, the
    tensors or the round's options), or claims a shard rank already taken."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(ErrorCode.LOCAL_MISMATCH, message, rank=rank)
        self.rank = rank


class LocalLate(IPCError):
    """The local group under the key had already left for its swarm round when this trainer
    came: it keeps its values, and the next round includes it."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.LOCAL_LATE, message)
