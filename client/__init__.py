"""moshpit: the trainer-side library for the moshpitd daemon."""

from moshpit.client import AGGREGATIONS, Client, RoundInfo
from moshpit.errors import (
    AllreduceFailed,
    DaemonShuttingDown,
    DaemonUnavailable,
    DuplicateRequest,
    GridMismatch,
    GroupNotFound,
    InvalidRequest,
    MoshpitError,
    ProtocolError,
    SchemaMismatch,
    StateUnavailable,
)
from moshpit.optimizer import Optimizer

__version__ = "0.1.0"

__all__ = [
    "AGGREGATIONS", "AllreduceFailed", "Client", "DaemonShuttingDown", "DaemonUnavailable",
    "DuplicateRequest", "GridMismatch", "GroupNotFound", "InvalidRequest", "MoshpitError",
    "Optimizer", "ProtocolError", "RoundInfo", "SchemaMismatch", "StateUnavailable",
]
