"""Errors raised by the trainer-side library; daemon errors keep the daemon's message.

Each error code of the IPC contract (moshpitd/ipc/schema.py, ErrorCode) is raised as exactly
one class here, the class whose `code` it is; errors the client finds itself (no daemon, a
lost connection) have no code.
"""

from __future__ import annotations

from typing import ClassVar

from moshpitd.ipc.schema import ErrorCode


class MoshpitError(Exception):
    """Base class of every moshpit client error (and what a code this client does not know
    becomes)."""

    code: ClassVar[ErrorCode | None] = None


class DaemonUnavailable(MoshpitError):
    """The daemon's socket cannot be reached, or it went away mid-request."""


class DaemonShuttingDown(DaemonUnavailable):
    """The daemon is draining (SIGTERM): it takes no new rounds; reconnect when it is back."""

    code = ErrorCode.SHUTTING_DOWN


class ProtocolError(MoshpitError):
    """The daemon and this client do not understand each other."""

    code = ErrorCode.PROTOCOL_ERROR


class InvalidRequest(MoshpitError):
    """The daemon refused the request as malformed (wrong types, sizes, layout)."""

    code = ErrorCode.INVALID_REQUEST


class GroupNotFound(MoshpitError):
    """Not enough peers averaged under the key before the timeout."""

    code = ErrorCode.GROUP_NOT_FOUND


class SchemaMismatch(MoshpitError):
    """Peers under the key submitted tensors of other shapes or dtypes. For the shards of a
    host (local_rank), `rank` is its first local rank whose tensors differ from that rank's at
    another shard host (None when no rank could be named)."""

    code = ErrorCode.SCHEMA_MISMATCH

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class GridMismatch(MoshpitError):
    """The run already uses another grid (here or at its other peers)."""

    code = ErrorCode.GRID_MISMATCH


class AllreduceFailed(MoshpitError):
    """A group was found but the all-reduce inside it failed."""

    code = ErrorCode.ALLREDUCE_FAILED


class StateUnavailable(MoshpitError):
    """No peer could provide the run's training state in time."""

    code = ErrorCode.STATE_UNAVAILABLE


class DuplicateRequest(MoshpitError):
    """The daemon already averages under this key."""

    code = ErrorCode.DUPLICATE_REQUEST


class DaemonBusy(DaemonUnavailable):
    """The daemon serves as many trainers as it may (its setting max_ipc_sessions)."""

    code = ErrorCode.TOO_MANY_SESSIONS


class VersionMismatch(ProtocolError):
    """The daemon speaks another IPC protocol: install matching moshpit and moshpitd."""

    code = ErrorCode.VERSION_MISMATCH


class RoundTimeout(MoshpitError):
    """A step of the round ran out of the request's time before it could fail otherwise."""

    code = ErrorCode.ROUND_TIMEOUT


class LocalRankMissing(MoshpitError):
    """A shard rank of this host left or never came (`rank`: the first missing): the host's
    vector was incomplete, so every rank failed and nothing was sent."""

    code = ErrorCode.LOCAL_RANK_MISSING

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class LocalMismatch(InvalidRequest):
    """Local trainers under the key disagree on local_world, the mode, the tensors or the
    round's options (`rank`: the one that differs from the first to come)."""

    code = ErrorCode.LOCAL_MISMATCH

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class LocalLate(MoshpitError):
    """This trainer came after its local group had left for the round: it keeps its values."""

    code = ErrorCode.LOCAL_LATE


class DaemonError(MoshpitError):
    """The daemon failed in a way it did not anticipate (a bug): its log has the traceback."""

    code = ErrorCode.INTERNAL_ERROR


# the classes a daemon's reply can raise, one per ErrorCode
CODED: tuple[type[MoshpitError], ...] = (
    InvalidRequest, ProtocolError, VersionMismatch, DaemonBusy, DaemonShuttingDown,
    DuplicateRequest, GroupNotFound, SchemaMismatch, GridMismatch, AllreduceFailed,
    RoundTimeout, StateUnavailable, LocalRankMissing, LocalMismatch, LocalLate, DaemonError)
BY_CODE: dict[str, type[MoshpitError]] = {str(cls.code): cls for cls in CODED}


def from_reply(reply: dict[str, object]) -> MoshpitError:
    """The exception an error reply stands for; its message starts with the code."""
    code = str(reply.get("error", "unknown"))
    message = str(reply.get("message", "the daemon reported an error"))
    cls = BY_CODE.get(code, MoshpitError)
    if issubclass(cls, LocalRankMissing | LocalMismatch | SchemaMismatch):
        rank = reply.get("rank")
        return cls(f"{code}: {message}", rank if isinstance(rank, int) else None)
    return cls(f"{code}: {message}")
