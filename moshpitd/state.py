"""Live training state for joiners: published by trainers, served by their daemons.

A trainer publishes its state (parameters, optimizer state, step counter) after each averaging
round; its daemon keeps a copy, so donors' trainers are never blocked by a download, and
announces itself under `{run}/donors`. A joiner's daemon downloads byte ranges from several
donors of the latest version at once; a range whose donor dies moves to another donor, resuming
at the byte where it stopped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import msgpack
from grpc import aio

from moshpitd.dht.network import DHTNode
from moshpitd.proto import moshpit_pb2 as pb
from moshpitd.transport.grpc_server import ChannelPool

log = logging.getLogger(__name__)

DONOR_TTL = 120.0
CHUNK = 1 << 20
RANGE = 4 << 20
MAX_DONORS = 4
MAX_HEADER = 1 << 20


class StateUnavailable(Exception):
    """No donor could provide the run's state in time."""


@dataclass
class Snapshot:
    version: int
    header: bytes  # msgpack {"tensors": [...], "meta": {...}}
    data: bytes
    published: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Donor:
    peer_id: bytes
    endpoint: str
    version: int
    total: int


@dataclass
class StateStore:
    dht: DHTNode
    peer_id: bytes
    endpoint: str
    snapshots: dict[str, Snapshot] = field(default_factory=dict)

    async def publish(self, key: str, tensors: list[list[Any]], meta: dict[str, Any],
                      data: bytes, version: int | None = None) -> int:
        # Donors that publish the same version (say, the same training step) are
        # interchangeable, so a download can take its byte ranges from several of them.
        version = time.time_ns() if version is None else version
        header = bytes(msgpack.packb({"tensors": tensors, "meta": meta}))
        if len(header) > MAX_HEADER:
            raise ValueError(f"state header of {len(header)} bytes exceeds {MAX_HEADER}")
        # a snapshot nobody republished within the donor record's lifetime is advertised by no
        # one any more: drop it rather than hold its bytes forever
        stale = time.monotonic() - DONOR_TTL
        for old in [k for k, snap in self.snapshots.items() if snap.published < stale]:
            del self.snapshots[old]
        self.snapshots[key] = Snapshot(version, header, data)
        value = bytes(msgpack.packb([self.endpoint, version, len(data)]))
        await self.dht.store_sub(f"{key}/donors", self.peer_id, value, DONOR_TTL)
        return version

    async def withdraw_all(self) -> None:
        """A draining daemon stops offering its snapshots, so joiners do not pick it."""
        keys = list(self.snapshots)
        self.snapshots.clear()
        await asyncio.gather(*(self.dht.withdraw_sub(f"{k}/donors", self.peer_id) for k in keys),
                             return_exceptions=True)

    # --- serving ------------------------------------------------------------------------
    async def serve(self, request: pb.StateRequest,
                    context: aio.ServicerContext) -> AsyncIterator[pb.StateChunk]:
        snap = self.snapshots.get(request.key)
        if snap is None or (request.version and request.version != snap.version):
            await context.abort(grpc.StatusCode.NOT_FOUND if snap is None
                                else grpc.StatusCode.FAILED_PRECONDITION,
                                f"no state of version {request.version} for {request.key!r}")
            return
        total = len(snap.data)
        if request.length == 0:
            yield pb.StateChunk(offset=0, total=total, version=snap.version, header=snap.header)
            return
        end = min(request.offset + request.length, total)
        for pos in range(request.offset, end, CHUNK):
            stop = min(pos + CHUNK, end)
            yield pb.StateChunk(offset=pos, data=snap.data[pos:stop], total=total,
                                version=snap.version)

    # --- downloading --------------------------------------------------------------------
    async def donors(self, key: str) -> list[Donor]:
        out = []
        for pid, rec in (await self.dht.get_subs(f"{key}/donors")).items():
            if pid == self.peer_id:
                continue
            try:
                endpoint, version, total = msgpack.unpackb(rec.value)
                if isinstance(endpoint, str) and isinstance(version, int) and \
                        isinstance(total, int) and 0 <= total < 1 << 40:
                    out.append(Donor(pid, endpoint, version, total))
            except Exception:  # a malformed record is no donor
                continue
        return out

    async def header(self, key: str, pool: ChannelPool, timeout: float
                     ) -> tuple[Donor, dict[str, Any], list[Donor]]:
        """The latest state's description and the donors that hold it."""
        deadline = time.monotonic() + timeout
        while True:
            donors = await self.donors(key)
            # newest version first; if none of its donors answers (it died, or its record is
            # forged), an older version that a live donor holds is better than nothing
            for version in sorted({d.version for d in donors}, reverse=True):
                holders = [d for d in donors if d.version == version]
                for d in holders:
                    try:
                        chunk = await _first(pool, d, pb.StateRequest(key=key, length=0,
                                                                      version=version),
                                             min(max(deadline - time.monotonic(), 0.1), 5.0))
                        info = msgpack.unpackb(chunk.header)
                        return d, info, holders
                    except (aio.AioRpcError, TimeoutError, ValueError) as exc:
                        log.info("state donor %s failed: %r", d.endpoint, exc)
            if time.monotonic() >= deadline:
                raise StateUnavailable(f"no donor answered for run {key!r} within "
                                       f"{timeout:.1f} s ({len(donors)} declared)")
            await asyncio.sleep(0.2)

    async def download(self, key: str, donors: list[Donor], into: memoryview,
                       pool: ChannelPool, timeout: float) -> int:
        """Fills `into` with the state; returns how many donors served it."""
        total = donors[0].total
        if len(into) < total:
            raise ValueError(f"buffer of {len(into)} bytes cannot hold {total} bytes of state")
        todo: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        for start in range(0, total, RANGE):
            todo.put_nowait((start, min(start + RANGE, total)))
        served: set[bytes] = set()
        failed: set[bytes] = set()
        alive = list(donors[:MAX_DONORS])

        async def worker(d: Donor) -> None:
            while not todo.empty():
                start, stop = todo.get_nowait()
                pos = start
                try:
                    call = pool.download(d.endpoint, pb.StateRequest(
                        key=key, offset=start, length=stop - start, version=d.version), timeout)
                    async for chunk in call:
                        n = len(chunk.data)
                        if chunk.offset != pos or pos + n > stop:
                            raise ValueError("donor sent a chunk out of place")
                        into[pos:pos + n] = chunk.data
                        pos += n
                    if pos != stop:
                        raise ValueError("donor stopped short")
                    served.add(d.peer_id)
                except (aio.AioRpcError, ValueError) as exc:
                    log.info("state donor %s failed at byte %d: %r; its range moves on",
                             d.endpoint, pos, exc)
                    todo.put_nowait((pos, stop))  # resume where it stopped, elsewhere
                    failed.add(d.peer_id)
                    return

        async with asyncio.timeout(timeout):
            while not todo.empty():
                if not alive:
                    raise StateUnavailable(f"every donor of run {key!r} failed mid-download")
                await asyncio.gather(*(worker(d) for d in alive))
                alive = [d for d in alive if d.peer_id not in failed]
        return len(served)


async def _first(pool: ChannelPool, donor: Donor, request: pb.StateRequest,
                 timeout: float) -> pb.StateChunk:
    call = pool.download(donor.endpoint, request, timeout)
    try:
        async for chunk in call:
            if len(chunk.header) > MAX_HEADER:
                raise ValueError("state header too large")
            return chunk
    finally:
        call.cancel()
    raise ValueError("donor sent nothing")
