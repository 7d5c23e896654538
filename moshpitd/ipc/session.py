"""One trainer's session: requests decoded by moshpitd/ipc/schema.py, answered in order of
completion (each reply carries its request's id).

A session starts with `hello` at this daemon's IPC_PROTOCOL; a trainer of another protocol is
told so and the session ends. A malformed request gets an error reply naming the op and the
field, and the session goes on; a frame that breaks the framing ends the session. Every
failure's code is chosen here: by the check that refuses a request, or, for a failure inside a
round or a state transfer, by the per-op tables of ipc/failures.py (by exception type).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import Coroutine
from dataclasses import replace
from typing import Any, Protocol

from moshpitd import __version__, timebase
from moshpitd.allreduce.codecs import CODECS
from moshpitd.allreduce.layout import FlatView, LayoutError, TensorSpec, specs_from_wire
from moshpitd.ipc import schema as wire
from moshpitd.ipc.buffer import COLLECT_EVERY, BufferError_, SharedBuffer, unmap
from moshpitd.ipc.failures import error_code
from moshpitd.ipc.framing import ConnectionClosed, FramedSocket, ProtocolError
from moshpitd.ipc.schema import ErrorCode, FieldError, IPCError
from moshpitd.matchmaking.grid import Grid, GridError
from moshpitd.node import MoshpitNode
from moshpitd.rounds import AverageRequest, DataReady
from moshpitd.state import StateStore


class SessionHost(Protocol):
    """What a session needs of the server that accepted it (moshpitd/ipc/server.py)."""

    node: MoshpitNode
    draining: bool
    metrics_endpoint: str
    path: str


log = logging.getLogger(__name__)

MAX_BUFFER = 16 << 30
MAX_INFLIGHT = 8
# Mappings one session may hold: a buffer per id (wire.MAX_BUFFERS ids), and buffers replaced by
# a new attach while requests in flight still used them (at most one per request), freed as soon
# as none does. Each is a trainer's memfd mapped into the daemon: a trainer attaching again and
# again must not exhaust the daemon's memory maps.
MAX_MAPPINGS = wire.MAX_BUFFERS + MAX_INFLIGHT
ROUND_OPS = frozenset({"average", "publish_state", "download_state"})  # refused while draining

class Session:
    def __init__(self, server: SessionHost, conn: FramedSocket, number: int) -> None:
        self.server = server
        self.node = server.node
        self.conn = conn
        self.number = number
        self.buffers: dict[int, SharedBuffer] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self._retired: list[SharedBuffer] = []
        self.greeted = False  # hello at our protocol came
        self._pending: dict[int, DataReady] = {}  # a pending average's id -> its data

    async def run(self) -> None:
        try:
            while await self.dispatch(await self.conn.read_frame()):
                pass
        except ConnectionClosed:
            pass
        except ProtocolError as exc:
            log.info("ipc session %d: protocol error: %s", self.number, exc)
            self.node.metrics.ipc_requests.labels("invalid", "error").inc()
            with contextlib.suppress(OSError):
                await self.conn.write_frame(wire.error_frame(None, ErrorCode.PROTOCOL_ERROR,
                                                             str(exc)))
        except OSError as exc:
            log.info("ipc session %d: connection error: %s", self.number, exc)
        finally:
            await self.close()

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        left = unmap([*self.buffers.values(), *self._retired])
        if left:  # once the collector may run again; what is still held goes with its views
            asyncio.get_running_loop().call_later(2 * COLLECT_EVERY, unmap, left)
        self.buffers.clear()
        self._retired.clear()
        self.conn.close()

    async def dispatch(self, frame: dict[str, Any]) -> bool:
        """Answers or starts one request; False when the session must end."""
        rid = frame.get("id")
        if not isinstance(rid, int | str | type(None)) or isinstance(rid, bool):
            rid = None
        op = "invalid"  # the metric label until the op is known: a peer's strings mint none
        try:
            op, fields = wire.split_request(frame)
            if op == "hello":
                return await self._hello(rid, fields)
            if not self.greeted:
                raise IPCError(ErrorCode.PROTOCOL_ERROR, f"{op} before hello: a session starts "
                               f"with {{'op': 'hello', 'protocol': {wire.IPC_PROTOCOL}}}")
            if self.server.draining and op in ROUND_OPS:
                raise IPCError(ErrorCode.SHUTTING_DOWN,
                               "moshpitd is shutting down: it takes no new rounds")
            if op == "attach":
                reply: wire.Message = self._attach(fields)
            elif op == "status":
                wire.decode(wire.StatusRequest, fields)
                reply = wire.StatusReply(self.node.status(), self.server.metrics_endpoint,
                                         self.server.path)
            elif op == "rounds":
                wire.decode(wire.RoundsRequest, fields)
                reply = wire.RoundsReply(self.node.recent_rounds())
            elif op == "ready":
                reply = self._ready(wire.decode(wire.ReadyRequest, fields))
            else:
                self._start(op, fields, rid)
                return True
            self.node.metrics.ipc_requests.labels(op, "ok").inc()
            await self.conn.write_frame(wire.reply_frame(rid, reply))
        except IPCError as exc:
            await self._refuse(op, rid, exc.code, str(exc))
        except OSError:
            raise  # the connection's: the session ends (see run)
        except Exception as exc:  # a bug of ours: the trainer still gets an answer
            log.exception("ipc session %d: %s failed", self.number, op)
            await self._refuse(op, rid, ErrorCode.INTERNAL_ERROR, f"daemon error: {exc!r}")
        return True

    async def _refuse(self, op: str, rid: Any, code: ErrorCode, message: str,
                      **extra: Any) -> None:
        self.node.metrics.ipc_requests.labels(op, "error").inc()
        await self.conn.write_frame(wire.error_frame(rid, code, message, **extra))

    async def _hello(self, rid: Any, fields: dict[str, Any]) -> bool:
        theirs = fields.get("protocol", 1)  # before the type check: any client learns ours
        if theirs != wire.IPC_PROTOCOL or isinstance(theirs, bool):
            why = (f"this moshpitd ({__version__}) speaks IPC protocol {wire.IPC_PROTOCOL}, the "
                   f"trainer's moshpit library speaks {theirs!r:.40}: install matching versions")
            log.warning("ipc session %d: refused: %s", self.number, why)
            await self._refuse("hello", rid, ErrorCode.VERSION_MISMATCH, why,
                               protocol=wire.IPC_PROTOCOL)
            return False
        wire.decode(wire.HelloRequest, fields)
        self.greeted = True
        self.node.metrics.ipc_requests.labels("hello", "ok").inc()
        await self.conn.write_frame(wire.reply_frame(rid, wire.HelloReply(
            self.node.peer_id.hex(), __version__, wire.IPC_PROTOCOL)))
        return True

    def _attach(self, fields: dict[str, Any]) -> wire.AttachReply:
        fd = self.conn.take_fd()
        try:
            req = wire.decode(wire.AttachRequest, fields)
            if fd is None:
                raise FieldError("attach", "size", "announces a memfd that did not come: pass "
                                 "one with SCM_RIGHTS in the same message")
            self._check_room(req.buffer)
            owned, fd = fd, None
            new = SharedBuffer(owned, req.size, MAX_BUFFER)  # closes it, whatever happens
        except BufferError_ as exc:
            raise IPCError(ErrorCode.INVALID_REQUEST, f"attach: {exc}") from None
        finally:
            if fd is not None:
                os.close(fd)
        old = self.buffers.get(req.buffer)
        self.buffers[req.buffer] = new
        if old is not None:
            self._retired.append(old)
            self._free_retired()  # unless requests in flight still use it
        return wire.AttachReply(req.size, req.buffer)

    def _check_room(self, bid: int) -> None:
        self._free_retired()  # views a finished request left may be gone by now
        old = self.buffers.get(bid)
        held = len(self.buffers) + len(self._retired) + (old is None or old.users > 0)
        if held > MAX_MAPPINGS:
            raise IPCError(ErrorCode.INVALID_REQUEST, (
                f"attach: this session would hold {held} shared buffers, over the daemon's "
                f"limit of {MAX_MAPPINGS} ({len(self.buffers)} attached, {len(self._retired)} "
                "replaced but still in use by requests or by views of them): wait for those "
                "requests before attaching again"))

    def _free_retired(self) -> None:
        """Unmap every replaced buffer that no request uses any more."""
        self._retired = [*(b for b in self._retired if b.users),
                         *unmap(b for b in self._retired if not b.users)]

    def _release(self, buffer: SharedBuffer, _: object = None) -> None:
        buffer.users -= 1
        if not buffer.users and buffer in self._retired:
            self._free_retired()

    def _ready(self, req: wire.ReadyRequest) -> wire.ReadyReply:
        ready = self._pending.get(req.request)
        if ready is None:
            raise FieldError("ready", "request", f"names no pending average in this session "
                             f"({req.request!r:.40}): it finished, failed or was not pending")
        ready.arrive(req.abandon)
        return wire.ReadyReply()

    def _start(self, op: str, fields: dict[str, Any], rid: Any) -> None:
        used: SharedBuffer | None = None  # the shared buffer the request works in, if any
        pending: DataReady | None = None
        if op == "average":
            req = wire.decode(wire.AverageRequest, fields)
            if req.pending:
                if not isinstance(rid, int) or rid in self._pending:
                    raise FieldError(op, "pending", "needs an integer id that no other pending "
                                     "average of this session has: `ready` names it by that")
                pending = DataReady()
            request = replace(self._average_request(req), ready=pending)
            used = self._buffer(op, req.buffer)
            work: Coroutine[Any, Any, wire.Message] = self._average(request, used)
        elif op == "publish_state":
            pub = wire.decode(wire.PublishStateRequest, fields)
            used = self._buffer(op, pub.buffer)
            work = self._publish(pub, used)
        elif op == "state_info":
            work = self._state_info(wire.decode(wire.StateInfoRequest, fields))
        elif op == "download_state":
            down = wire.decode(wire.DownloadStateRequest, fields)
            used = self._buffer(op, down.buffer)
            work = self._download(down, used)
        else:
            wire.decode(wire.PeersRequest, fields)
            work = self._peers()
        if len(self.tasks) >= MAX_INFLIGHT:
            work.close()
            raise IPCError(ErrorCode.INVALID_REQUEST,
                           f"at most {MAX_INFLIGHT} requests in flight per session")
        task = asyncio.create_task(self._reply_when_done(work, op, rid))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        if pending is not None:
            self._pending[rid] = pending
            task.add_done_callback(lambda _: self._pending.pop(rid, None))
        if used is not None:  # a re-attach under its id unmaps it once the request is done
            used.users += 1
            task.add_done_callback(functools.partial(self._release, used))

    async def _reply_when_done(self, work: Coroutine[Any, Any, wire.Message], op: str,
                               rid: Any) -> None:
        try:
            frame = wire.reply_frame(rid, await work)
            self.node.metrics.ipc_requests.labels(op, "ok").inc()
        except asyncio.CancelledError:
            if self.server.draining:  # cut off by the drain deadline: still say why
                with contextlib.suppress(OSError, asyncio.CancelledError):
                    await self.conn.write_frame(wire.error_frame(
                        rid, ErrorCode.SHUTTING_DOWN, "moshpitd is shutting down: the round "
                        "did not finish within its drain timeout"))
            raise
        except Exception as exc:
            self.node.metrics.ipc_requests.labels(op, "error").inc()
            code = error_code(op, exc)
            if code is None:  # a bug of ours: the trainer still gets an answer
                log.exception("ipc session %d: %s failed", self.number, op)
                frame = wire.error_frame(rid, ErrorCode.INTERNAL_ERROR, f"daemon error: {exc!r}")
            else:
                frame = wire.error_frame(rid, code, str(exc) or repr(exc),
                                         **getattr(exc, "extra", {}))
        with contextlib.suppress(OSError):
            await self.conn.write_frame(frame)

    def _buffer(self, op: str, bid: int) -> SharedBuffer:
        buffer = self.buffers.get(bid)
        if buffer is None:
            raise FieldError(op, "buffer", f"names no shared buffer {bid} attached: send "
                             "'attach' with a memfd first")
        return buffer

    def _average_request(self, req: wire.AverageRequest) -> AverageRequest:
        """The daemon's request: what only this daemon can check (its limits, codecs, grids)."""
        limit = self.node.config.max_group_size
        if req.group_size > limit:
            raise FieldError("average", "group_size", f"{req.group_size} exceeds this "
                             f"daemon's limit {limit} (setting max_group_size)")
        specs = _specs("average", req.tensors)
        min_group, grid, coords = req.min_group_size, None, None
        if req.grid is not None:
            try:
                grid = Grid(req.grid[0], req.grid[1])
                coords = None if req.initial_coords is None else grid.check(req.initial_coords)
            except GridError as exc:
                raise FieldError("average", "grid", f"is unusable: {exc}") from None
            if grid.size < 2:
                raise FieldError("average", "grid", "needs at least 2 cells per dimension")
            if grid.size > limit:
                raise FieldError("average", "grid", f"groups of {grid.size} exceed this "
                                 f"daemon's limit {limit} (setting max_group_size)")
            min_group = min(min_group, grid.size)
        if req.codec not in CODECS:
            raise FieldError("average", "codec", f"is {req.codec!r}, not one of "
                             f"{', '.join(CODECS)}")
        return AverageRequest(req.key, specs, req.weight, req.timeout, req.group_size,
                              min_group, grid, req.rounds, coords, req.codec, req.aggregation,
                              req.local_world, req.local_rank)

    async def _average(self, request: AverageRequest, buffer: SharedBuffer
                       ) -> wire.AverageReply:
        result = await self.node.average(request, buffer.view())
        rounds = result.rounds
        return wire.AverageReply(
            group_size=max(result.last.group_size, 1),
            seconds=sum(r.seconds for r in rounds),
            matchmaking_seconds=sum(r.matchmaking_seconds for r in rounds),
            bytes_sent=sum(r.bytes_sent for r in rounds),
            bytes_received=sum(r.bytes_received for r in rounds),
            round=result.last_round,
            coords=None if result.coords is None else list(result.coords),
            group_sizes=[max(r.group_size, 1) for r in rounds],
            spans=[list(span) for span in result.spans],
            members=list(result.members), owned=result.owned, local_rank=result.local_rank,
            local_ranks=list(result.local_ranks))

    async def _peers(self) -> wire.PeersReply:
        peers = await self.node.peers()
        return wire.PeersReply(peers["contacts"], peers["runs"])

    # --- live state for joiners (moshpitd/state.py) -------------------------------------
    async def _publish(self, req: wire.PublishStateRequest, buffer: SharedBuffer
                       ) -> wire.PublishStateReply:
        data, packed = FlatView(buffer.view(), _specs(req.OP, req.tensors)).pack()
        version = await self._store().publish(req.key, packed, req.meta, data, req.version)
        return wire.PublishStateReply(version, len(data))

    async def _state_info(self, req: wire.StateInfoRequest) -> wire.StateInfoReply:
        _, info, holders = await self._store().header(req.key, self.node.pool, req.timeout,
                                                      req.version)
        return wire.StateInfoReply(holders[0].total, holders[0].version,
                                   list(info.get("tensors", [])), dict(info.get("meta", {})),
                                   len(holders))

    async def _download(self, req: wire.DownloadStateRequest, buffer: SharedBuffer
                        ) -> wire.DownloadStateReply:
        # one deadline, the request's, for finding a donor and downloading from it
        deadline = timebase.monotonic() + req.timeout
        store = self._store()
        _, info, holders = await store.header(req.key, self.node.pool, req.timeout,
                                              req.version)
        remaining = deadline - timebase.monotonic()
        if remaining <= 0:
            raise IPCError(ErrorCode.STATE_UNAVAILABLE, f"finding a donor of run {req.key!r} "
                           f"took the whole timeout ({req.timeout:g} s)")
        served_by = await store.download(req.key, info, holders, buffer.view(), self.node.pool,
                                         remaining)
        return wire.DownloadStateReply(holders[0].total, holders[0].version,
                                       list(info.get("tensors", [])),
                                       dict(info.get("meta", {})), len(holders), served_by)

    def _store(self) -> StateStore:
        store = self.node.states
        if store is None:
            raise IPCError(ErrorCode.STATE_UNAVAILABLE, "this daemon has not started yet")
        return store


def _specs(op: str, tensors: list[list[Any]]) -> tuple[TensorSpec, ...]:
    try:
        return specs_from_wire(tensors)
    except (LayoutError, ValueError) as exc:
        raise FieldError(op, "tensors", f"is malformed: {exc}") from None
