"""moshpit: the trainer-side library for the moshpitd daemon."""

from moshpit.client import AGGREGATIONS, Client, RoundInfo
from moshpit.errors import (
    AllreduceFailed,
    DaemonBusy,
    DaemonError,
    DaemonShuttingDown,
    DaemonUnavailable,
    DuplicateRequest,
    GridMismatch,
    GroupNotFound,
    InvalidRequest,
    LocalLate,
    LocalMismatch,
    LocalRankMissing,
    MoshpitError,
    ProtocolError,
    RoundTimeout,
    SchemaMismatch,
    StateUnavailable,
    VersionMismatch,
)
from moshpit.optimizer import Optimizer

__version__ = "0.1.0"

__all__ = [
    "AGGREGATIONS", "AllreduceFailed", "Client", "DaemonBusy", "DaemonError",
    "DaemonShuttingDown", "DaemonUnavailable", "DuplicateRequest", "GridMismatch",
    "GroupNotFound", "InvalidRequest", "LocalLate", "LocalMismatch", "LocalRankMissing",
    "MoshpitError", "Optimizer", "ProtocolError",
    "RoundInfo", "RoundTimeout", "SchemaMismatch", "StateUnavailable", "VersionMismatch",
]
