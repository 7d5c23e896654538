"""IPC server: one session per trainer connection.

Operations (each a msgpack map with "op"; replies carry the request's "id"):
  hello                      -> peer id and version
  attach {size}  + one fd    -> maps the trainer's memfd (replaces any earlier buffer)
  average {key, tensors, weight, timeout, group_size, min_group_size, aggregation, ...}
                             -> averages tensors in the buffer in place
  status, rounds, peers      -> daemon state for the CLI
Any malformed frame gets an error reply; a frame that breaks the framing closes the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from typing import Any, Protocol

from moshpitd import __version__
from moshpitd.allreduce.butterfly import AllreduceError
from moshpitd.allreduce.codecs import CODECS
from moshpitd.allreduce.layout import FlatView, LayoutError, specs_from_wire
from moshpitd.allreduce.robust import AGGREGATIONS
from moshpitd.ipc.buffer import BufferError_, SharedBuffer
from moshpitd.ipc.framing import ConnectionClosed, FramedSocket, ProtocolError
from moshpitd.matchmaking.errors import MatchmakingError
from moshpitd.matchmaking.grid import Grid, GridError
from moshpitd.node import AverageRequest, MoshpitNode, ShuttingDown
from moshpitd.state import StateUnavailable


class SessionHost(Protocol):
    """What a session needs of the server that accepted it (moshpitd/ipc/server.py)."""

    node: MoshpitNode
    draining: bool
    metrics_endpoint: str
    path: str

log = logging.getLogger(__name__)

MAX_BUFFER = 16 << 30
MAX_INFLIGHT = 8
MAX_BUFFERS = 64
KNOWN_OPS = frozenset({"hello", "attach", "average", "status", "rounds", "peers", "publish_state",
                       "state_info", "download_state"})


class RequestError(Exception):
    """A well-framed request with bad contents: answered with an error, session goes on."""


def _field(msg: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None,
           required: bool = False) -> Any:
    if name not in msg:
        if required:
            raise RequestError(f"missing field {name!r}")
        return default
    value = msg[name]
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise RequestError(f"field {name!r} has the wrong type (bool)")
    if not isinstance(value, kind):
        raise RequestError(f"field {name!r} has the wrong type ({type(value).__name__})")
    return value


class Session:
    def __init__(self, server: SessionHost, conn: FramedSocket, number: int) -> None:
        self.server = server
        self.node = server.node
        self.conn = conn
        self.number = number
        self.buffers: dict[int, SharedBuffer] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self._retired: list[SharedBuffer] = []

    async def run(self) -> None:
        try:
            while True:
                msg = await self.conn.read_frame()
                await self.dispatch(msg)
        except ConnectionClosed:
            pass
        except ProtocolError as exc:
            log.info("ipc session %d: protocol error: %s", self.number, exc)
            self.node.metrics.ipc_requests.labels("invalid", "error").inc()
            with contextlib.suppress(OSError):
                await self.conn.write_frame({"ok": False, "error": "ProtocolError",
                                             "message": str(exc)})
        except OSError as exc:
            log.info("ipc session %d: connection error: %s", self.number, exc)
        finally:
            await self.close()

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for buf in [*self.buffers.values(), *self._retired]:
            buf.close()
        self.buffers.clear()
        self.conn.close()

    async def dispatch(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        rid = msg.get("id")
        if not isinstance(rid, int | str | type(None)) or isinstance(rid, bool):
            rid = None
        try:
            if not isinstance(op, str):
                raise RequestError("field 'op' must be a string")
            if self.server.draining and op in ("average", "publish_state", "download_state"):
                raise ShuttingDown("moshpitd is shutting down: it takes no new rounds")
            if op == "average":
                self._start_average(msg, rid)
                return
            if op in ("publish_state", "state_info", "download_state"):
                self._start_task(self._state_op(op, msg), op, rid)
                return
            if op == "peers":
                self._start_task(self.node.peers(), op, rid)
                return
            handler = {"hello": self._hello, "attach": self._attach, "status": self._status,
                       "rounds": self._rounds}.get(op)
            if handler is None:
                raise RequestError(f"unknown op {op!r}")
            reply = handler(msg)
            self.node.metrics.ipc_requests.labels(op, "ok").inc()
            await self.conn.write_frame({"ok": True, "id": rid, **reply})
        except (RequestError, BufferError_, LayoutError, ValueError, ShuttingDown) as exc:
            # only known operations become label values: a peer's strings must not mint series
            known = isinstance(op, str) and op in KNOWN_OPS
            self.node.metrics.ipc_requests.labels(op if known else "invalid", "error").inc()
            await self.conn.write_frame({"ok": False, "id": rid, "error": type(exc).__name__
                                         .rstrip("_"), "message": str(exc)})

    def _hello(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {"peer_id": self.node.peer_id.hex(), "version": __version__}

    def _status(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {"status": self.node.status(), "metrics": self.server.metrics_endpoint,
                "ipc": self.server.path}

    def _rounds(self, msg: dict[str, Any]) -> dict[str, Any]:
        return {"rounds": self.node.recent_rounds()}

    def _attach(self, msg: dict[str, Any]) -> dict[str, Any]:
        fd = self.conn.take_fd()
        try:
            size = _field(msg, "size", int, required=True)
        except RequestError:
            if fd is not None:
                os.close(fd)
            raise
        if fd is None:
            raise RequestError("attach needs a memfd passed with SCM_RIGHTS in the same message")
        try:
            bid = _field(msg, "buffer", int, 0)
            if not 0 <= bid < MAX_BUFFERS:
                raise RequestError(f"buffer id must be in 0..{MAX_BUFFERS - 1}")
        except RequestError:
            os.close(fd)
            raise
        new = SharedBuffer(fd, size, MAX_BUFFER)
        old = self.buffers.get(bid)
        if old is not None:
            self._retired.append(old)  # requests in flight may still use it
        self.buffers[bid] = new
        return {"size": size, "buffer": bid}

    def _start_average(self, msg: dict[str, Any], rid: Any) -> None:
        key = _field(msg, "key", str, required=True)
        if not 0 < len(key) <= 256:
            raise RequestError("key must have 1..256 characters")
        tensors = _field(msg, "tensors", list, required=True)
        if len(tensors) > 100_000:
            raise RequestError("too many tensors in one request (limit 100000)")
        weight = float(_field(msg, "weight", (int, float), 1.0))
        timeout = float(_field(msg, "timeout", (int, float), 30.0))
        group_size = _field(msg, "group_size", int, 16)
        min_group = _field(msg, "min_group_size", int, 2)
        if not (math.isfinite(weight) and weight >= 0):
            raise RequestError("weight must be a finite number >= 0")
        if not (math.isfinite(timeout) and 0 < timeout <= 3600):
            raise RequestError("timeout must be in (0, 3600] seconds")
        if not 1 <= min_group <= group_size:
            raise RequestError("need 1 <= min_group_size <= group_size")
        limit = self.node.config.max_group_size
        if group_size > limit:
            raise RequestError(f"group_size {group_size} exceeds this daemon's limit {limit} "
                               "(setting max_group_size)")
        bid = _field(msg, "buffer", int, 0)
        if bid not in self.buffers:
            raise RequestError(f"no shared buffer {bid} attached: send 'attach' with a memfd "
                               "first")
        specs = specs_from_wire(tensors)
        grid_field = _field(msg, "grid", (list, type(None)))
        grid = None
        if grid_field is not None:
            if not (len(grid_field) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                 for x in grid_field)):
                raise RequestError("grid must be [M, d] (cells per dimension, dimensions)")
            try:
                grid = Grid(grid_field[0], grid_field[1])
            except GridError as exc:
                raise RequestError(str(exc)) from None
            if grid.size < 2:
                raise RequestError("a grid needs at least 2 cells per dimension")
            if grid.size > self.node.config.max_group_size:
                raise RequestError(f"grid groups of {grid.size} exceed this daemon's limit "
                                   f"{self.node.config.max_group_size} (setting max_group_size)")
            min_group = min(min_group, grid.size)
        rounds = _field(msg, "rounds", int, 1)
        if not 1 <= rounds <= 1000:
            raise RequestError("rounds must be in 1..1000")
        if rounds > 1 and grid is None:
            raise RequestError("rounds > 1 needs a grid")
        coords = _field(msg, "initial_coords", (list, type(None)))
        if coords is not None:
            if grid is None:
                raise RequestError("initial_coords needs a grid")
            try:
                coords = grid.check(coords)
            except GridError as exc:
                raise RequestError(str(exc)) from None
        codec = _field(msg, "codec", str, "none")
        if codec not in CODECS:
            raise RequestError(f"codec {codec!r} is not one of {', '.join(CODECS)}")
        aggregation = _field(msg, "aggregation", str, "mean")
        if aggregation not in AGGREGATIONS:
            raise RequestError(f"aggregation {aggregation!r} is not one of "
                               f"{', '.join(AGGREGATIONS)}")
        request = AverageRequest(key, specs, weight, timeout, group_size, min_group, grid,
                                 rounds, coords, codec, aggregation)
        self._start_task(self._average(request, self.buffers[bid]), "average", rid)

    def _start_task(self, coro: Any, op: str, rid: Any) -> None:
        if len(self.tasks) >= MAX_INFLIGHT:
            coro.close()
            raise RequestError(f"at most {MAX_INFLIGHT} requests in flight per session")
        task = asyncio.create_task(self._reply_when_done(coro, op, rid))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _reply_when_done(self, coro: Any, op: str, rid: Any) -> None:
        try:
            reply = {"ok": True, "id": rid, **(await coro)}
            self.node.metrics.ipc_requests.labels(op, "ok").inc()
        except (RequestError, StateUnavailable, MatchmakingError, AllreduceError, LayoutError,
                ValueError, TimeoutError, ShuttingDown) as exc:
            self.node.metrics.ipc_requests.labels(op, "error").inc()
            reply = {"ok": False, "id": rid, "error": type(exc).__name__, "message": str(exc)}
        except asyncio.CancelledError:
            if self.server.draining:  # cut off by the drain deadline: still say why
                with contextlib.suppress(OSError, asyncio.CancelledError):
                    await self.conn.write_frame({
                        "ok": False, "id": rid, "error": "ShuttingDown",
                        "message": "moshpitd is shutting down: the round did not finish within "
                                   "its drain timeout"})
            raise
        except Exception as exc:  # a bug of ours: the trainer still gets an answer
            log.exception("ipc session %d: %s failed", self.number, op)
            self.node.metrics.ipc_requests.labels(op, "error").inc()
            reply = {"ok": False, "id": rid, "error": "InternalError",
                     "message": f"daemon error: {exc!r}"}
        with contextlib.suppress(OSError):
            await self.conn.write_frame(reply)

    async def _state_op(self, op: str, msg: dict[str, Any]) -> dict[str, Any]:
        # live state for joiners (see moshpitd/state.py)
        key = _field(msg, "key", str, required=True)
        timeout = float(_field(msg, "timeout", (int, float), 30.0))
        if not (0 < len(key) <= 256 and 0 < timeout <= 3600):
            raise RequestError("key must have 1..256 characters and timeout be in (0, 3600]")
        store, pool = self.node.states, self.node.pool
        assert store is not None
        if op == "publish_state":
            meta = _field(msg, "meta", dict, {})
            buffer = self._buffer(msg)
            view = FlatView(buffer.view(), specs_from_wire(_field(msg, "tensors", list,
                                                                    required=True)))
            data, packed = view.pack()
            version = _field(msg, "version", (int, type(None)))
            if version is not None and not 0 < version < 1 << 63:
                raise RequestError("version must be a positive 63-bit integer")
            version = await store.publish(key, packed, meta, data, version)
            return {"version": version, "total": len(data)}
        # one deadline for finding a donor and downloading: the trainer waits no longer
        deadline = time.monotonic() + timeout
        version = _field(msg, "version", int, 0)  # download_state: the version state_info saw
        _, info, holders = await store.header(key, pool, timeout, version)
        reply = {"total": holders[0].total, "version": holders[0].version,
                 "tensors": info.get("tensors", []), "meta": info.get("meta", {}),
                 "donors": len(holders)}
        if op == "download_state":
            buffer = self._buffer(msg)
            remaining = max(deadline - time.monotonic(), 0.1)
            reply["served_by"] = await store.download(key, info, holders, buffer.view(), pool,
                                                      remaining)
        return reply

    def _buffer(self, msg: dict[str, Any]) -> SharedBuffer:
        bid = _field(msg, "buffer", int, 0)
        if bid not in self.buffers:
            raise RequestError(f"no shared buffer {bid} attached: send 'attach' with a memfd "
                               "first")
        return self.buffers[bid]

    async def _average(self, request: AverageRequest, buffer: SharedBuffer) -> dict[str, Any]:
        result = await self.node.average(request, buffer.view())
        rounds = result.rounds
        return {"group_size": max(result.last.group_size, 1),
                "seconds": sum(r.seconds for r in rounds),
                "matchmaking_seconds": sum(r.matchmaking_seconds for r in rounds),
                "bytes_sent": sum(r.bytes_sent for r in rounds),
                "bytes_received": sum(r.bytes_received for r in rounds),
                "round": result.last_round, "coords": result.coords,
                "group_sizes": [max(r.group_size, 1) for r in rounds],
                "spans": [list(span) for span in result.spans],
                "members": list(result.members), "owned": result.owned}
