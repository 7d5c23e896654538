"""One butterfly all-reduce round over gRPC streams (scatter-reduce + all-gather, pipelined).

Member j reduces span j. Every member streams its parts of span j to member j, which accumulates
them as they arrive and streams each averaged part back as soon as all senders delivered it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
from grpc import aio

from moshpitd.allreduce.group import Group
from moshpitd.allreduce.layout import DEFAULT_PART_BYTES, FlatView, Part, plan_parts
from moshpitd.allreduce.reducer import PartReducer, ReductionError
from moshpitd.proto import moshpit_pb2 as pb
from moshpitd.transport import frames
from moshpitd.transport.grpc_server import ChannelPool

log = logging.getLogger(__name__)


class AllreduceError(Exception):
    """The round could not produce an average for this peer."""


@dataclass(frozen=True)
class RoundResult:
    group_size: int
    parts: int
    bytes_sent: int
    bytes_received: int
    seconds: float


class ButterflyRound:
    def __init__(self, group: Group, my_index: int, view: FlatView, pool: ChannelPool,
                 part_bytes: int = DEFAULT_PART_BYTES) -> None:
        self.group = group
        self.me = my_index
        self.view = view
        self.pool = pool
        self.parts = plan_parts(view.runs, group.shares, part_bytes)
        self.by_owner: dict[int, list[Part]] = defaultdict(list)
        for p in self.parts:
            self.by_owner[p.owner].append(p)
        self.my_parts = self.by_owner.get(my_index, [])
        dtypes = {i: np.dtype(r.dtype) for i, r in enumerate(view.runs)}
        self.dtypes = dtypes
        self.reducer = PartReducer(self.my_parts, dtypes, senders=len(group.members))
        self._done = {p.index: asyncio.Event() for p in self.my_parts}
        self._results: dict[int, np.ndarray] = {}
        self._served: set[int] = set()
        self._error: Exception | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self._deadline = time.monotonic() + 60.0

    # --- our side ------------------------------------------------------------------------
    async def run(self, timeout: float) -> RoundResult:
        start = time.perf_counter()
        self._deadline = time.monotonic() + timeout
        try:
            async with asyncio.timeout(timeout):
                weight = self.group.members[self.me].weight
                for p in self.my_parts:
                    self._contribute(p, self.me, weight, self.view.read(p))
                async with asyncio.TaskGroup() as tg:
                    for owner, parts in self.by_owner.items():
                        if owner != self.me:
                            tg.create_task(self._exchange(owner, parts))
                    tg.create_task(self._finish_own())
        except TimeoutError as exc:
            self._abort(AllreduceError(f"all-reduce did not finish within {timeout:.1f} s"))
            raise AllreduceError(
                f"all-reduce in group of {len(self.group.members)} did not finish within "
                f"{timeout:.1f} s"
            ) from exc
        except asyncio.CancelledError:
            self._abort(AllreduceError("the peer cancelled its request"))
            raise
        except Exception as exc:
            first = _first_leaf(exc)
            self._abort(AllreduceError(str(first)))
            if isinstance(first, _EXPECTED):
                raise AllreduceError(_describe(first)) from first
            raise
        return RoundResult(len(self.group.members), len(self.parts), self.bytes_sent,
                           self.bytes_received, time.perf_counter() - start)

    async def _exchange(self, owner: int, parts: list[Part]) -> None:
        member = self.group.members[owner]
        call = self.pool.reduce(member.endpoint, timeout=self._deadline - time.monotonic())
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._send_parts(call, parts))
                tg.create_task(self._receive_parts(call, owner, parts))
        finally:
            call.cancel()

    async def _send_parts(self, call: Any, parts: list[Part]) -> None:
        for p in parts:
            data = self.view.read(p)
            header = pb.PartHeader(group_id=self.group.group_id, sender=self.me, part=p.index)
            frame = frames.encode(header, data.data.cast("B"))
            self.bytes_sent += len(frame)
            await call.write(frame)
        await call.done_writing()

    async def _receive_parts(self, call: Any, owner: int, parts: list[Part]) -> None:
        for p in parts:
            frame = await call.read()
            if frame is aio.EOF:
                raise AllreduceError(f"peer {owner} closed its stream before part {p.index}")
            header, payload = frames.decode(frame)
            if header.status != pb.OK:
                raise AllreduceError(f"peer {owner} aborted: {header.message}")
            if header.part != p.index:
                raise AllreduceError(f"peer {owner} sent part {header.part}, expected {p.index}")
            values = np.frombuffer(payload, dtype=self.dtypes[p.run])
            if values.size != p.numel:
                raise AllreduceError(f"peer {owner} returned {values.size} elements for part "
                                     f"{p.index}, expected {p.numel}")
            self.bytes_received += len(frame)
            self.view.write(p, values)

    async def _finish_own(self) -> None:
        for p in self.my_parts:
            await self._wait_part(p.index)
            self.view.write(p, self._results[p.index])

    # --- the reducer side: one sender's stream -------------------------------------------
    async def serve(self, sender: int, first: bytes, context: aio.ServicerContext) -> None:
        if not 0 <= sender < len(self.group.members) or sender == self.me:
            await context.write(self._abort_frame(f"sender index {sender} is not valid here"))
            return
        if sender in self._served:
            await context.write(self._abort_frame(f"sender {sender} already has a stream"))
            return
        self._served.add(sender)
        weight = self.group.members[sender].weight
        reader = asyncio.create_task(self._read_sender(sender, weight, first, context))
        try:
            for p in self.my_parts:
                await self._wait_part(p.index)
                header = pb.PartHeader(group_id=self.group.group_id, sender=self.me, part=p.index)
                frame = frames.encode(header, self._results[p.index].data.cast("B"))
                self.bytes_sent += len(frame)
                await context.write(frame)
        except AllreduceError as exc:
            await context.write(self._abort_frame(str(exc)))
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _read_sender(self, sender: int, weight: float, frame: Any,
                           context: aio.ServicerContext) -> None:
        try:
            while frame is not aio.EOF:
                header, payload = frames.decode(frame)
                if header.sender != sender or header.group_id != self.group.group_id:
                    raise AllreduceError(f"sender {sender} sent a frame for another stream")
                if header.status != pb.OK:
                    raise AllreduceError(f"sender {sender} aborted: {header.message}")
                if not 0 <= header.part < len(self.parts):
                    raise AllreduceError(f"sender {sender} sent unknown part {header.part}")
                part = self.parts[header.part]
                values = np.frombuffer(payload, dtype=self.dtypes[part.run])
                self.bytes_received += len(frame)
                self._contribute(part, sender, weight, values)
                frame = await context.read()
        except (AllreduceError, ReductionError, frames.FrameError) as exc:
            self._abort(AllreduceError(f"bad stream from member {sender}: {exc}"))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the stream broke (peer gone)
            self._abort(AllreduceError(f"stream from member {sender} broke: {exc!r}"))

    # --- shared ----------------------------------------------------------------------------
    def _contribute(self, part: Part, sender: int, weight: float, values: np.ndarray) -> None:
        if part.owner != self.me:
            raise ReductionError(f"part {part.index} is not reduced by member {self.me}")
        if self.reducer.add(part.index, sender, weight, values):
            self._results[part.index] = self.reducer.result(part.index)
            self._done[part.index].set()

    async def _wait_part(self, index: int) -> None:
        await self._done[index].wait()
        if index not in self._results:
            raise self._error or AllreduceError("round aborted")

    def _abort(self, exc: Exception) -> None:
        if self._error is None:
            self._error = exc
        for ev in self._done.values():
            ev.set()

    def _abort_frame(self, message: str) -> bytes:
        return frames.encode(pb.PartHeader(group_id=self.group.group_id, sender=self.me,
                                           status=pb.ABORT, message=message))


_EXPECTED = (AllreduceError, ReductionError, frames.FrameError, aio.AioRpcError, OSError)


def _first_leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def _describe(exc: BaseException) -> str:
    if isinstance(exc, aio.AioRpcError):
        return f"peer stream failed: {exc.code().name}: {exc.details()}"
    return str(exc)
