"""The IPC contract between a trainer (moshpit.Client) and its daemon, in one place.

Every frame is a msgpack map behind a 4-byte big-endian length. A request is
`{"op": NAME, "id": ID, **fields}`; its reply is `{"ok": true, "id": ID, **fields}` or
`{"ok": false, "id": ID, "error": CODE, "message": TEXT}`. Each op's fields are the frozen
dataclasses below; both sides decode by field name and refuse a missing, unknown or wrongly
typed field with an error naming the op and the field. CODE is an `ErrorCode`: stable strings,
chosen by the daemon where it refuses or fails a request, and mapped one-to-one onto the
client's exceptions (client/errors.py).

A session starts with `hello`, which carries `IPC_PROTOCOL`; the daemon answers only a session
whose protocol it speaks. Raise IPC_PROTOCOL whenever a field, an op or a code changes.

Stdlib only (no torch, no numpy, no daemon modules beyond moshpitd/ipc/errors.py, the codes,
and moshpitd/ipc/message.py, the decoding): the client imports this module, and so do the
daemon's allreduce modules for the constants the two sides must share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from moshpitd.ipc.errors import ErrorCode, FieldError, IPCError
from moshpitd.ipc.message import Message, decode, encode

# 1: the unversioned protocol (errors named by Python class, no handshake); 3: local groups
# (their error replies, schema_mismatch's included, may carry the local `rank` at fault);
# 4: `average` with `pending` and the `ready` op (the buffer is filled while matchmaking runs)
IPC_PROTOCOL = 4
MAX_FRAME = 1 << 20  # bytes of one frame's payload: control messages only, never tensor bytes
LENGTH_PREFIX = 4  # bytes of a frame's big-endian length
BUFFER_ALIGN = 64  # bytes: every tensor in a shared buffer (and a state snapshot) starts here
MAX_BUFFERS = 64  # shared buffers per session: ids 0..MAX_BUFFERS-1 (0 is the client's scratch)
AGGREGATIONS = ("mean", "trimmed_mean", "centered_clip")  # see moshpitd/allreduce/robust.py
MAX_KEY = 256  # characters of a key
MAX_TIMEOUT = 3600.0  # s: the longest a request may ask for
MAX_TENSORS = 100_000  # tensors in one request
MAX_ROUNDS = 1000  # rounds of one grid request
MAX_LOCAL_WORLD = 1024  # local trainers of one host averaging as one peer (moshpitd/local/)
DEFAULT_TIMEOUT = 30.0  # s: a request's timeout when it names none
# s a trainer waits for a reply beyond the request's own timeout: the daemon's round ends
# within that timeout (moshpitd/clock.py); the margin covers a daemon under load writing the
# reply. Past it the client gives up and reports the daemon unavailable.
REPLY_MARGIN = 10.0
# s a trainer waits for ops that do no network round (hello, attach, status, rounds)
LOCAL_REPLY_TIMEOUT = 10.0


def aligned(offset: int) -> int:
    """The first BUFFER_ALIGN-aligned offset at or after `offset`."""
    return (offset + BUFFER_ALIGN - 1) // BUFFER_ALIGN * BUFFER_ALIGN


def _in_range(op: str, name: str, value: float, low: float, high: float,
              low_open: bool = False) -> None:
    above_low = low < value if low_open else low <= value
    if not (math.isfinite(value) and above_low and value <= high):
        bracket = "(" if low_open else "["
        raise FieldError(op, name, f"must be in {bracket}{low:g}, {high:g}], not {value!r}")


def _check_key(op: str, key: str) -> None:
    if not 0 < len(key) <= MAX_KEY:
        raise FieldError(op, "key", f"must have 1..{MAX_KEY} characters")


def _check_timeout(op: str, timeout: float) -> None:
    _in_range(op, "timeout", timeout, 0.0, MAX_TIMEOUT, low_open=True)


def _check_buffer(op: str, buffer: int) -> None:
    if not 0 <= buffer < MAX_BUFFERS:
        raise FieldError(op, "buffer", f"must be in 0..{MAX_BUFFERS - 1}")

# --- requests and replies, per op --------------------------------------------------------
@dataclass(frozen=True)
class HelloRequest(Message):
    OP = "hello"
    protocol: int = 1  # a client of the unversioned protocol sends none


@dataclass(frozen=True)
class HelloReply(Message):
    OP = "hello"
    peer_id: str
    version: str  # the daemon's package version
    protocol: int


@dataclass(frozen=True)
class AttachRequest(Message):
    """Sent with one memfd (SCM_RIGHTS): it becomes shared buffer `buffer`."""

    OP = "attach"
    size: int
    buffer: int = 0

    def validate(self) -> None:
        _check_buffer(self.OP, self.buffer)


@dataclass(frozen=True)
class AttachReply(Message):
    OP = "attach"
    size: int
    buffer: int


@dataclass(frozen=True)
class AverageRequest(Message):
    """`tensors`: [[dtype, shape, offset], ...] in buffer `buffer` (checked by the daemon's
    allreduce/layout.py)."""

    OP = "average"
    key: str
    tensors: list[list[Any]]
    weight: float = 1.0
    timeout: float = DEFAULT_TIMEOUT
    group_size: int = 16
    min_group_size: int = 2
    grid: list[int] | None = None  # [M, d]
    rounds: int = 1
    initial_coords: list[int] | None = None
    codec: str = "none"
    aggregation: str = "mean"
    buffer: int = 0
    # One of local_world trainers of this host, which average as one peer: replicas (no
    # local_rank) or the shards of one vector, in rank order (moshpitd/local/)
    local_world: int | None = None
    local_rank: int | None = None
    # The tensors are not in the buffer yet: the trainer copies them in (from a GPU, say) while
    # the daemon looks for a group, and says `ready` with this request's id once they are; the
    # daemon reads the buffer only after that
    pending: bool = False

    def validate(self) -> None:
        op = self.OP
        _check_key(op, self.key)
        if len(self.tensors) > MAX_TENSORS:
            raise FieldError(op, "tensors", f"lists too many tensors (limit {MAX_TENSORS})")
        if not (math.isfinite(self.weight) and self.weight >= 0):
            raise FieldError(op, "weight", "must be a finite number >= 0")
        _check_timeout(op, self.timeout)
        if not 1 <= self.min_group_size <= self.group_size:
            raise FieldError(op, "min_group_size", "must satisfy 1 <= min_group_size <= "
                             "group_size")
        if self.grid is not None and len(self.grid) != 2:
            raise FieldError(op, "grid", "must be [M, d] (cells per dimension, dimensions)")
        if not 1 <= self.rounds <= MAX_ROUNDS:
            raise FieldError(op, "rounds", f"must be in 1..{MAX_ROUNDS}")
        if self.grid is None and self.rounds > 1:
            raise FieldError(op, "rounds", "> 1 needs a grid")
        if self.grid is None and self.initial_coords is not None:
            raise FieldError(op, "initial_coords", "needs a grid")
        if self.aggregation not in AGGREGATIONS:
            raise FieldError(op, "aggregation", f"is {self.aggregation!r}, not one of "
                             f"{', '.join(AGGREGATIONS)}")
        _check_buffer(op, self.buffer)
        if self.local_world is not None and not 1 <= self.local_world <= MAX_LOCAL_WORLD:
            raise FieldError(op, "local_world", f"must be in 1..{MAX_LOCAL_WORLD}")
        if self.local_rank is not None:
            if self.local_world is None:
                raise FieldError(op, "local_rank", "needs local_world (the shards' count)")
            if not 0 <= self.local_rank < self.local_world:
                raise FieldError(op, "local_rank", f"must be in 0..{self.local_world - 1} "
                                 f"(local_world {self.local_world})")
        if self.pending and self.local_world is not None:
            raise FieldError(op, "pending", "is for requests without local_world (a local "
                             "group reads its trainers' buffers as they arrive)")


@dataclass(frozen=True)
class ReadyRequest(Message):
    """The tensors of the pending `average` with id `request` are in its buffer now."""

    OP = "ready"
    request: int
    abandon: bool = False  # the copy failed: the daemon must send nothing of the buffer


@dataclass(frozen=True)
class ReadyReply(Message):
    OP = "ready"


@dataclass(frozen=True)
class AverageReply(Message):
    OP = "average"
    group_size: int
    seconds: float
    matchmaking_seconds: float
    bytes_sent: int
    bytes_received: int
    round: int | None  # the grid round (None without a grid)
    coords: list[int] | None  # this peer's cell on the grid
    group_sizes: list[int]  # one per round
    spans: list[list[int]]  # [start, stop, members' bitmask] over the flat tensors
    members: list[str]  # peer ids: bit i of a mask is members[i]
    owned: int  # elements this peer reduced
    # with local_world: this trainer's local rank (replicas: its order of arrival), and the
    # local ranks whose values the host's contribution holds
    local_rank: int | None = None
    local_ranks: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class PublishStateRequest(Message):
    OP = "publish_state"
    key: str
    tensors: list[list[Any]]
    meta: dict[str, Any] = field(default_factory=dict)
    version: int | None = None  # None: the daemon picks (the time of publication)
    timeout: float = DEFAULT_TIMEOUT
    buffer: int = 0

    def validate(self) -> None:
        _check_key(self.OP, self.key)
        _check_timeout(self.OP, self.timeout)
        if self.version is not None and not 0 < self.version < 1 << 63:
            raise FieldError(self.OP, "version", "must be a positive 63-bit integer")
        _check_buffer(self.OP, self.buffer)


@dataclass(frozen=True)
class PublishStateReply(Message):
    OP = "publish_state"
    version: int
    total: int  # bytes of the snapshot


@dataclass(frozen=True)
class StateInfoRequest(Message):
    OP = "state_info"
    key: str
    timeout: float = DEFAULT_TIMEOUT
    version: int = 0  # 0: the newest

    def validate(self) -> None:
        _check_key(self.OP, self.key)
        _check_timeout(self.OP, self.timeout)


@dataclass(frozen=True)
class StateInfoReply(Message):
    OP = "state_info"
    total: int
    version: int
    tensors: list[list[Any]]  # where each tensor lies in the snapshot
    meta: dict[str, Any]
    donors: int  # peers holding that version


@dataclass(frozen=True)
class DownloadStateRequest(Message):
    OP = "download_state"
    key: str
    version: int = 0  # the version state_info saw (0: the newest)
    timeout: float = DEFAULT_TIMEOUT
    buffer: int = 0

    def validate(self) -> None:
        _check_key(self.OP, self.key)
        _check_timeout(self.OP, self.timeout)
        _check_buffer(self.OP, self.buffer)


@dataclass(frozen=True)
class DownloadStateReply(StateInfoReply):
    OP = "download_state"
    served_by: int  # donors that sent some of it


@dataclass(frozen=True)
class StatusRequest(Message):
    OP = "status"


@dataclass(frozen=True)
class StatusReply(Message):
    OP = "status"
    status: dict[str, Any]
    metrics: str  # the /metrics endpoint
    ipc: str  # the socket path


@dataclass(frozen=True)
class RoundsRequest(Message):
    OP = "rounds"


@dataclass(frozen=True)
class RoundsReply(Message):
    OP = "rounds"
    rounds: list[dict[str, Any]]


@dataclass(frozen=True)
class PeersRequest(Message):
    OP = "peers"


@dataclass(frozen=True)
class PeersReply(Message):
    OP = "peers"
    contacts: list[dict[str, Any]]  # [{peer_id, dht}]
    runs: dict[str, Any]  # run -> [{peer_id, coords, round, grpc, joining}]


@dataclass(frozen=True)
class OpSpec:
    request: type[Message]
    reply: type[Message]
    takes_fd: bool = False  # the request comes with one descriptor
    network: bool = False  # it waits on peers: bounded by its timeout, not LOCAL_REPLY_TIMEOUT


OPS: dict[str, OpSpec] = {spec.request.OP: spec for spec in (
    OpSpec(HelloRequest, HelloReply),
    OpSpec(AttachRequest, AttachReply, takes_fd=True),
    OpSpec(AverageRequest, AverageReply, network=True),
    OpSpec(ReadyRequest, ReadyReply),
    OpSpec(PublishStateRequest, PublishStateReply, network=True),
    OpSpec(StateInfoRequest, StateInfoReply, network=True),
    OpSpec(DownloadStateRequest, DownloadStateReply, network=True),
    OpSpec(StatusRequest, StatusReply),
    OpSpec(RoundsRequest, RoundsReply),
    OpSpec(PeersRequest, PeersReply, network=True),
)}
assert all(s.request.OP == s.reply.OP for s in OPS.values())

def request_frame(msg: Message, rid: int) -> dict[str, Any]:
    return {"op": msg.OP, "id": rid, **encode(msg)}


def reply_frame(rid: Any, msg: Message) -> dict[str, Any]:
    return {"ok": True, "id": rid, **encode(msg)}


def error_frame(rid: Any, code: ErrorCode, message: str, **extra: Any) -> dict[str, Any]:
    return {"ok": False, "id": rid, "error": code.value, "message": message, **extra}


def split_request(frame: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(op, fields) of a request frame; the op must be one of OPS."""
    op = frame.get("op")
    if not isinstance(op, str):
        raise FieldError("request", "op", "must be a string naming the op")
    if op not in OPS:
        raise IPCError(ErrorCode.INVALID_REQUEST, f"unknown op {op!r:.80} (ops: "
                       f"{', '.join(OPS)})")
    return op, {k: v for k, v in frame.items() if k not in ("op", "id")}


def decode_reply(op: str, frame: dict[str, Any]) -> Message:
    """An ok reply to `op`, by field name; a reply that does not fit is a protocol_error."""
    fields = {k: v for k, v in frame.items() if k not in ("ok", "id")}
    return decode(OPS[op].reply, fields, ErrorCode.PROTOCOL_ERROR)


__all__ = [
    "AGGREGATIONS", "BUFFER_ALIGN", "DEFAULT_TIMEOUT", "IPC_PROTOCOL", "LENGTH_PREFIX",
    "LOCAL_REPLY_TIMEOUT", "MAX_BUFFERS", "MAX_FRAME", "MAX_KEY", "MAX_LOCAL_WORLD", "MAX_ROUNDS",
    "MAX_TENSORS", "MAX_TIMEOUT", "OPS", "REPLY_MARGIN", "ErrorCode", "FieldError", "IPCError",
    "Message", "OpSpec", "aligned", "decode", "decode_reply", "encode", "error_frame",
    "reply_frame", "request_frame", "split_request",
]
