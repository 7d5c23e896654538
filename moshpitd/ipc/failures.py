"""What a failure inside an IPC op's work is called: its ErrorCode, chosen by the exception's
type (first match in the op's table), never by its name. Refusals of a request itself are
IPCErrors raised with their code where they are checked (ipc/session.py)."""

from __future__ import annotations

from moshpitd.allreduce.butterfly import AllreduceError
from moshpitd.ipc.schema import ErrorCode, IPCError
from moshpitd.matchmaking.errors import DuplicateRequest, MatchmakingError, SchemaMismatch
from moshpitd.matchmaking.runs import GridMismatch
from moshpitd.node_config import ShuttingDown
from moshpitd.state import StateUnavailable

ErrorTable = tuple[tuple[type[BaseException], ErrorCode], ...]
_DRAIN = ((ShuttingDown, ErrorCode.SHUTTING_DOWN),)
AVERAGE_ERRORS: ErrorTable = (
    *_DRAIN,
    (DuplicateRequest, ErrorCode.DUPLICATE_REQUEST),
    (SchemaMismatch, ErrorCode.SCHEMA_MISMATCH),
    (GridMismatch, ErrorCode.GRID_MISMATCH),
    (MatchmakingError, ErrorCode.GROUP_NOT_FOUND),  # GroupNotFound and its kin
    (AllreduceError, ErrorCode.ALLREDUCE_FAILED),
    # every step of a round is bounded by the round's clock; one that still ran out of time
    # failed the round (it is not a state transfer: see STATE_ERRORS)
    (TimeoutError, ErrorCode.ROUND_TIMEOUT),
    (ValueError, ErrorCode.INVALID_REQUEST),  # the tensors vs the buffer and the daemon's limits
)
STATE_ERRORS: ErrorTable = (
    *_DRAIN,
    (StateUnavailable, ErrorCode.STATE_UNAVAILABLE),
    (TimeoutError, ErrorCode.STATE_UNAVAILABLE),  # the download's deadline passed
    (ValueError, ErrorCode.INVALID_REQUEST),  # the tensors vs the buffer
)
OP_ERRORS: dict[str, ErrorTable] = {"average": AVERAGE_ERRORS, "publish_state": STATE_ERRORS,
                                    "state_info": STATE_ERRORS, "download_state": STATE_ERRORS}


def error_code(op: str, exc: BaseException) -> ErrorCode | None:
    """The code of a failure of `op`; None for one nobody anticipated (a daemon bug)."""
    if isinstance(exc, IPCError):
        return exc.code
    for kind, code in OP_ERRORS.get(op, ()):
        if isinstance(exc, kind):
            return code
    return None
