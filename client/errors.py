"""Errors raised by the trainer-side library; daemon errors keep the daemon's message."""

from __future__ import annotations


class MoshpitError(Exception):
    """Base class of every moshpit client error."""


class DaemonUnavailable(MoshpitError):
    """The daemon's socket cannot be reached, or it went away mid-request."""


class DaemonShuttingDown(DaemonUnavailable):
    """The daemon is draining (SIGTERM): it takes no new rounds; reconnect when it is back."""


class ProtocolError(MoshpitError):
    """The daemon and this client do not understand each other."""


class InvalidRequest(MoshpitError):
    """The daemon refused the request as malformed (wrong types, sizes, layout)."""


class GroupNotFound(MoshpitError):
    """Not enough peers averaged under the key before the timeout."""


class SchemaMismatch(MoshpitError):
    """Peers under the key submitted tensors of other shapes or dtypes."""


class GridMismatch(MoshpitError):
    """The run already uses another grid (here or at its other peers)."""


class AllreduceFailed(MoshpitError):
    """A group was found but the all-reduce inside it failed."""


class StateUnavailable(MoshpitError):
    """No peer could provide the run's training state in time."""


class DuplicateRequest(MoshpitError):
    """The daemon already averages under this key."""


_BY_NAME: dict[str, type[MoshpitError]] = {
    "GroupNotFound": GroupNotFound,
    "SchemaMismatch": SchemaMismatch,
    "GridMismatch": GridMismatch,
    "StateUnavailable": StateUnavailable,
    "TimeoutError": StateUnavailable,
    "AllreduceError": AllreduceFailed,
    "DuplicateRequest": DuplicateRequest,
    "MatchmakingError": GroupNotFound,
    "ProtocolError": ProtocolError,
    "RequestError": InvalidRequest,
    "LayoutError": InvalidRequest,
    "BufferError": InvalidRequest,
    "ValueError": InvalidRequest,
    "TooManySessions": DaemonUnavailable,
    "ShuttingDown": DaemonShuttingDown,
}


def from_reply(reply: dict[str, object]) -> MoshpitError:
    name = str(reply.get("error", "MoshpitError"))
    message = str(reply.get("message", "the daemon reported an error"))
    return _BY_NAME.get(name, MoshpitError)(f"{name}: {message}")
