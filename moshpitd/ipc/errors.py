"""What a failed IPC request is called: an ErrorCode (stable strings on the wire) and the
exceptions that carry one inside the daemon. The client raises one class per code
(client/errors.py)."""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    """Why a request failed. Stable strings: never a Python class name."""

    INVALID_REQUEST = "invalid_request"  # malformed fields, sizes or layout
    PROTOCOL_ERROR = "protocol_error"  # broken framing, or an op before hello
    VERSION_MISMATCH = "version_mismatch"  # the two sides speak different IPC_PROTOCOLs
    TOO_MANY_SESSIONS = "too_many_sessions"  # the daemon's max_ipc_sessions are taken
    SHUTTING_DOWN = "shutting_down"  # the daemon drains: no new rounds
    DUPLICATE_REQUEST = "duplicate_request"  # the daemon already averages under the key
    GROUP_NOT_FOUND = "group_not_found"  # too few peers came before the timeout
    SCHEMA_MISMATCH = "schema_mismatch"  # peers declared other tensors under the key
    GRID_MISMATCH = "grid_mismatch"  # the run uses another grid
    ALLREDUCE_FAILED = "allreduce_failed"  # a group formed, its all-reduce failed
    ROUND_TIMEOUT = "round_timeout"  # a round's step ran out of the request's time
    STATE_UNAVAILABLE = "state_unavailable"  # no donor gave the state in time
    LOCAL_RANK_MISSING = "local_rank_missing"  # a shard rank of this host left or never came
    LOCAL_MISMATCH = "local_mismatch"  # local trainers under the key disagree (names the rank)
    LOCAL_LATE = "local_late"  # the local group had left for its round when this trainer came
    INTERNAL_ERROR = "internal_error"  # a daemon bug: its log has the traceback


class IPCError(Exception):
    """A request refused or failed, with the code its reply carries."""

    def __init__(self, code: ErrorCode, message: str, **extra: int | str) -> None:
        super().__init__(message)
        self.code = code
        self.extra = extra  # fields the error reply carries besides code and message


class FieldError(IPCError):
    """A field of an op is missing, unknown, of the wrong type or out of range. Refused as
    invalid_request on the daemon side; a reply with one is a protocol_error on the client's."""

    def __init__(self, op: str, name: str, problem: str,
                 code: ErrorCode = ErrorCode.INVALID_REQUEST) -> None:
        super().__init__(code, f"{op}: field {name!r:.80} {problem}")  # a peer's name: cut
        self.op = op
        self.field = name
