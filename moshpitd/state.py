"""Live training state for joiners: published by trainers, served by their daemons.

A trainer publishes its state (parameters, optimizer state, step counter) after each averaging
round; its daemon keeps a copy, so donors' trainers are never blocked by a download, and
announces itself under `{run}/donors`. A joiner's daemon downloads byte ranges from several
donors of the latest version at once; a range whose donor dies moves to another donor, resuming
at the byte where it stopped.

Which donors a joiner takes the state from is judged in donors.py: versions that no other
peer's record comes near are refused, and bytes are vouched for only where holders agree.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack

from moshpitd import timebase
from moshpitd.dht.network import DHTNode
from moshpitd.donors import (
    HEADER_WAIT_MAX,
    HEADER_WAIT_MIN,
    MAX_HEADER,
    Donor,
    agreed,
    headers,
    vouched,
)
from moshpitd.hooks import NO_HOOKS, Hooks
from moshpitd.proto import moshpit_pb2 as pb
from moshpitd.transport.control import (
    FAILED_PRECONDITION,
    NOT_FOUND,
    ControlClient,
    ControlError,
)

log = logging.getLogger(__name__)

DONOR_TTL = 120.0  # s a donor record lives: a trainer republishes far more often than this
CHUNK = 1 << 20  # bytes of state per streamed StateChunk
RANGE = 4 << 20  # bytes per digested range: what a download checks and moves between donors
MAX_DONORS = 4  # donors one download reads from at once
MAX_STATE_BYTES = 1 << 40  # a donor record announcing more is malformed (max_request_bytes' cap)
DONOR_POLL = 0.2  # s between DHT lookups while no donor has answered (e.g. none published
# yet): each lookup asks the k closest nodes, and a new donor is found within this
LEASE = 60.0  # a version a joiner asked for stays served this long after its last request
MAX_KEPT = 3  # versions kept per key: the latest and ones still being downloaded
SUPERSEDED_GRACE = 10.0  # a replaced version stays served this long


class StateUnavailable(Exception):
    """No donor could provide the run's state in time."""


def range_digests(data: bytes | memoryview, size: int = RANGE) -> list[bytes]:
    """One BLAKE2b digest per byte range: a joiner checks every range it assembles, so a range
    from a donor holding other bytes under the same version (a diverged peer, a liar) is
    caught and fetched again elsewhere. (hashlib releases the GIL: this runs in a thread.)"""
    view = memoryview(data)
    return [hashlib.blake2b(view[i:i + size], digest_size=16).digest()
            for i in range(0, len(view), size)]


@dataclass
class Snapshot:
    version: int
    header: bytes  # msgpack {"tensors": [...], "meta": {...}, "range": int, "digests": [...]}
    data: bytes
    published: float = field(default_factory=timebase.monotonic)
    leased_until: float = 0.0  # pinned while a joiner downloads it
    grace_until: float = 0.0  # just replaced: a joiner may have read its record


@dataclass
class StateStore:
    dht: DHTNode
    peer_id: bytes
    endpoint: str
    snapshots: dict[str, list[Snapshot]] = field(default_factory=dict)  # oldest first
    hooks: Hooks = NO_HOOKS  # the fault tests act here
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    _warned: set[tuple[bytes, int]] = field(default_factory=set)  # refused versions logged

    async def publish(self, key: str, tensors: list[list[Any]], meta: dict[str, Any],
                      data: bytes, version: int | None = None) -> int:
        # Donors that publish the same version (say, the same training step) are
        # interchangeable, so a download can take its byte ranges from several of them.
        version = timebase.wall_ns() if version is None else version
        # one publish per key at a time: the latest to start is the latest served
        async with self._locks.setdefault(key, asyncio.Lock()):
            digests = await asyncio.to_thread(range_digests, data)
            header = bytes(msgpack.packb({"tensors": tensors, "meta": meta, "range": RANGE,
                                          "digests": digests}))
            if len(header) > MAX_HEADER:
                raise ValueError(f"state header of {len(header)} bytes exceeds {MAX_HEADER}")
            self._install(key, Snapshot(version, header, data, timebase.monotonic()))
            value = bytes(msgpack.packb([self.endpoint, version, len(data)]))
            await self.dht.store_sub(f"{key}/donors", self.peer_id, value, DONOR_TTL)
        return version

    def _install(self, key: str, snap: Snapshot) -> None:
        """Which versions stay: the latest; ones joiners are downloading (leased); the one it
        replaces, for SUPERSEDED_GRACE (a joiner may have just read the donor record); at most
        MAX_KEPT per key, leased ones before the replaced one. A snapshot nobody republished
        within the donor record's lifetime is advertised by no one any more: dropped."""
        now = snap.published
        for k in list(self.snapshots):
            *older, latest = self.snapshots[k]
            if k == key:
                if latest.version != snap.version:  # (the same version again: a refresh)
                    for old in older:
                        old.grace_until = 0.0  # only the version replaced now gets a grace
                    latest.grace_until = now + SUPERSEDED_GRACE
                    older.append(latest)
                top: Snapshot | None = snap
            else:
                alive = latest.leased_until > now or latest.published >= now - DONOR_TTL
                top = latest if alive else None
            older = [o for o in older if top is None or o.version != top.version]
            leased = [o for o in older if o.leased_until > now]
            graced = [o for o in older if o.grace_until > now and o not in leased]
            keep = sorted((leased + graced)[:MAX_KEPT - 1], key=lambda o: o.published)
            if top is not None:
                keep.append(top)
            if keep:
                self.snapshots[k] = keep
            else:
                del self.snapshots[k]
        if key not in self.snapshots:
            self.snapshots[key] = [snap]

    async def withdraw_all(self) -> None:
        """A draining daemon stops offering its snapshots, so joiners do not pick it."""
        keys = list(self.snapshots)
        self.snapshots.clear()
        await asyncio.gather(*(self.dht.withdraw_sub(f"{k}/donors", self.peer_id) for k in keys),
                             return_exceptions=True)

    # --- serving ------------------------------------------------------------------------
    def _find(self, key: str, version: int) -> Snapshot | None:
        snaps = self.snapshots.get(key)
        if not snaps:
            return None
        if not version:
            return snaps[-1]
        return next((snap for snap in snaps if snap.version == version), None)

    async def serve(self, request: pb.StateRequest) -> AsyncIterator[pb.StateChunk]:
        snap = self._find(request.key, request.version)
        if snap is None:
            raise ControlError(NOT_FOUND if request.key not in self.snapshots
                               else FAILED_PRECONDITION,
                               f"no state of version {request.version} for {request.key!r}")
        # a joiner that asked for this version gets it to the end, even if our trainer
        # publishes newer ones meanwhile
        snap.leased_until = timebase.monotonic() + LEASE
        total = len(snap.data)
        if request.length == 0:
            yield pb.StateChunk(offset=0, total=total, version=snap.version, header=snap.header)
            return
        end = min(request.offset + request.length, total)
        for sent, pos in enumerate(range(request.offset, end, CHUNK)):
            await self.hooks.serving_state(sent)
            stop = min(pos + CHUNK, end)
            yield pb.StateChunk(offset=pos, data=snap.data[pos:stop], total=total,
                                version=snap.version)

    # --- downloading --------------------------------------------------------------------
    async def donors(self, key: str) -> list[Donor]:
        """The donors a joiner may take the state from (see `vouched`)."""
        out = []
        for pid, rec in (await self.dht.get_subs(f"{key}/donors", max_ttl=DONOR_TTL)).items():
            if pid == self.peer_id:
                continue
            try:
                endpoint, version, total = msgpack.unpackb(rec.value)
                if isinstance(endpoint, str) and isinstance(version, int) and \
                        isinstance(total, int) and 0 <= total < MAX_STATE_BYTES:
                    out.append(Donor(pid, endpoint, version, total))
            except Exception:  # a malformed record is no donor
                continue
        kept, refused = vouched(out)
        for d in refused:
            if (d.peer_id, d.version) not in self._warned and len(self._warned) < 1024:
                self._warned.add((d.peer_id, d.version))
                log.warning("state of %r: donor %s announces version %d, beyond what any "
                            "other peer's record shows (%d at most): not taken", key,
                            d.peer_id.hex()[:8], d.version, kept[0].version)
        return kept

    async def header(self, key: str, pool: ControlClient, timeout: float, version: int = 0
                     ) -> tuple[Donor, dict[str, Any], list[Donor]]:
        """The latest state's description (or that of `version`) and the donors that hold it,
        the one that answered first."""
        deadline = timebase.monotonic() + timeout
        while True:
            donors = await self.donors(key)
            # newest version first; if none of its donors answers (it died, or its record is
            # forged), an older version that a live donor holds is better than nothing
            # (a donor that advertises a newer version may still serve an older one for a
            # while: asked for `version`, we try every such donor)
            versions = sorted({d.version for d in donors}, reverse=True) if not version \
                else [version]
            for v in versions:
                holders = [d for d in donors if d.version == v or (version and d.version > v)]
                gone = 0  # holders that answered they no longer have it
                for batch in range(0, len(holders), MAX_DONORS):
                    wait = min(max(deadline - timebase.monotonic(), HEADER_WAIT_MIN),
                               HEADER_WAIT_MAX)
                    answers, lost = await headers(key, v, holders[batch:batch + MAX_DONORS],
                                                   pool, wait)
                    gone += lost
                    if not answers:
                        continue
                    same = agreed(answers)
                    if same is not None:  # their bytes must be the same: theirs is taken
                        answers, holders = same, [d for d, _, _ in same]
                    first, info, _ = answers[0]
                    holders = [replace(h, version=v, total=first.total) for h in holders]
                    return first, info, [first, *(h for h in holders if h != first)]
                if version and holders and gone == len(holders):  # waiting will not bring it back
                    raise StateUnavailable(f"no donor offers version {version} of run {key!r} "
                                           "any more")
            if timebase.monotonic() >= deadline:
                what = f"version {version} of run {key!r}" if version else f"run {key!r}"
                raise StateUnavailable(f"no donor answered for {what} within "
                                       f"{timeout:.1f} s ({len(donors)} declared)")
            await asyncio.sleep(DONOR_POLL)

    async def download(self, key: str, info: dict[str, Any], donors: list[Donor],
                       into: memoryview, pool: ControlClient, timeout: float) -> int:
        """Fills `into` with the state; returns how many donors served it. Every range is
        checked against the header's digest; a donor that fails or sends other bytes is
        replaced by the next holder, and its range resumes where it stopped (or starts over,
        when the bytes were wrong)."""
        total, size, digests = donors[0].total, info["range"], info["digests"]
        if len(into) < total:
            raise ValueError(f"buffer of {len(into)} bytes cannot hold {total} bytes of state")
        todo: asyncio.Queue[tuple[int, int]] = asyncio.Queue()  # (range index, resume at)
        for index in range(len(digests)):
            todo.put_nowait((index, index * size))
        served: set[bytes] = set()
        failed: set[bytes] = set()
        spare: list[Donor] = []

        at: dict[int, int] = {}  # range index -> bytes of it in place so far

        async def fetch(d: Donor, index: int, pos: int) -> None:
            """Raises on a failed or lying donor; `at` says where the range stands."""
            start, stop = index * size, min((index + 1) * size, total)
            call = pool.download(d.endpoint, pb.StateRequest(
                key=key, offset=pos, length=stop - pos, version=d.version), timeout)
            async for chunk in call:
                n = len(chunk.data)
                if chunk.offset != pos or pos + n > stop:
                    raise ValueError("donor sent a chunk out of place")
                into[pos:pos + n] = chunk.data
                pos = at[index] = pos + n
            if pos != stop:
                raise ValueError("donor stopped short")
            digest = await asyncio.to_thread(range_digests, into[start:stop], size)
            if digest[0] != digests[index]:
                at[index] = start  # we cannot tell whose bytes were wrong: fetch it again
                raise _BadRange(f"bytes {start}..{stop} do not match the header's digest")

        async def worker(d: Donor | None) -> None:
            while d is not None:
                try:
                    index, pos = todo.get_nowait()
                except asyncio.QueueEmpty:
                    return
                try:
                    await fetch(d, index, pos)
                    served.add(d.peer_id)
                except (ControlError, ValueError) as exc:
                    resume = at.get(index, pos)
                    log.info("state donor %s failed at byte %d: %r; its range moves on",
                             d.endpoint, resume, exc)
                    todo.put_nowait((index, resume))
                    failed.add(d.peer_id)
                    d = spare.pop(0) if spare else None  # the next holder takes its place

        async with asyncio.timeout(timeout):
            while not todo.empty():
                usable = [d for d in donors if d.peer_id not in failed]
                if not usable:
                    raise StateUnavailable(f"every donor of run {key!r} failed mid-download")
                spare[:] = usable[MAX_DONORS:]
                await asyncio.gather(*(worker(d) for d in usable[:MAX_DONORS]))
        return len(served)


class _BadRange(ValueError):
    """A range's bytes do not match its digest: the donor holds other bytes."""


