"""moshpit: the trainer-side library for the moshpitd daemon."""

from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from moshpit.client import AGGREGATIONS, Client, RoundInfo
    from moshpit.optimizer import Optimizer

# Loaded on first use (PEP 562): these import torch, which the CLI (`moshpit status`) and
# anything else that only talks to a daemon never needs.
_LAZY = {"AGGREGATIONS": "moshpit.client", "Client": "moshpit.client",
         "RoundInfo": "moshpit.client", "Optimizer": "moshpit.optimizer"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'moshpit' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "AGGREGATIONS", "AllreduceFailed", "Client", "DaemonBusy", "DaemonError",
    "DaemonShuttingDown", "DaemonUnavailable", "DuplicateRequest", "GridMismatch",
    "GroupNotFound", "InvalidRequest", "LocalLate", "LocalMismatch", "LocalRankMissing",
    "MoshpitError", "Optimizer", "ProtocolError",
    "RoundInfo", "RoundTimeout", "SchemaMismatch", "StateUnavailable", "VersionMismatch",
]
