"""moshpit.Client: talks to the local moshpitd over its unix socket.

Tensor bytes go through a memfd that both sides map; only small msgpack frames cross the socket.
The buffer is sealed against shrinking (the daemon insists), grown by attaching a new memfd.
CUDA tensors are copied into and out of it asynchronously (client/device_copy.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moshpit.connection import decode_reply
from moshpit.control import DaemonControl
from moshpit.device_copy import DeviceCopier, address, on_cuda
from moshpit.errors import (
    InvalidRequest,
    MoshpitError,
    StateUnavailable,
)
from moshpit.round_info import RoundInfo, round_info
from moshpitd.ipc import schema as wire
from moshpitd.ipc.schema import (
    AGGREGATIONS,
    DEFAULT_TIMEOUT,
    LOCAL_REPLY_TIMEOUT,
    MAX_LOCAL_WORLD,
    REPLY_MARGIN,
    aligned,
)

_DTYPES = {torch.float16: "float16", torch.float32: "float32", torch.float64: "float64"}
# s: download_state does not start (or retry) a download with less time than this left; a
# state of any size takes longer than that to find and fetch
MIN_DOWNLOAD_TIME = 0.5


def check_aggregation(aggregation: str) -> str:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, not "
                         f"{aggregation!r}")
    return aggregation


def check_local(local_world: int | None, local_rank: int | None
                ) -> tuple[int | None, int | None]:
    """local_world (this host's trainers that average as one peer) and local_rank (a shard's
    rank; None for replicas), as the daemon will take them."""
    if local_world is None:
        if local_rank is not None:
            raise ValueError("local_rank needs local_world (the count of the host's shards)")
        return None, None
    if not 1 <= int(local_world) <= MAX_LOCAL_WORLD:
        raise ValueError(f"local_world must be in 1..{MAX_LOCAL_WORLD}, not {local_world}")
    if local_rank is not None and not 0 <= int(local_rank) < int(local_world):
        raise ValueError(f"local_rank must be in 0..{int(local_world) - 1}, not {local_rank}")
    return int(local_world), None if local_rank is None else int(local_rank)


def _layout(tensors: Sequence[torch.Tensor]) -> tuple[list[list[Any]], int]:
    specs, offset = [], 0
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor {i} is a {type(t).__name__}, not a torch.Tensor")
        dtype = _DTYPES.get(t.dtype)
        if dtype is None:
            raise TypeError(f"tensor {i} has dtype {t.dtype}; moshpit averages "
                            f"{', '.join(map(str, _DTYPES))}")
        offset = aligned(offset)
        specs.append([dtype, list(t.shape), offset])
        offset += t.numel() * t.element_size()
    return specs, max(offset, 1)


@dataclass(frozen=True)
class DeviceShare:
    """Device tensors made by share(): their values cross in the buffer reserved for them."""

    bid: int
    buf: mmap.mmap
    specs: list[list[Any]]
    tensors: list[torch.Tensor]

    def holds(self, tensors: list[torch.Tensor]) -> bool:
        return len(tensors) == len(self.tensors) and all(
            a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype
            and a.device == b.device for a, b in zip(tensors, self.tensors, strict=True))


class Client(DaemonControl):
    """One connection to a daemon. Thread-safe: requests are serialised."""

    def __init__(self, socket_path: str, connect_timeout: float = 5.0) -> None:
        self._mmap: mmap.mmap | None = None
        self._size = 0
        self._shared: list[tuple[int, int, int, mmap.mmap]] = []  # id, address, size, map
        self._device_shared: list[DeviceShare] = []
        self._device = DeviceCopier()
        self.last_round: RoundInfo | None = None
        # the last download_state: {"version", "donors" (holders seen), "served_by"}
        self.last_download: dict[str, int] | None = None
        super().__init__(socket_path, connect_timeout)

    # --- public API -----------------------------------------------------------------------
    def average(self, tensors: Sequence[torch.Tensor], key: str, weight: float = 1.0,
                timeout: float = DEFAULT_TIMEOUT, group_size: int = 16, min_group_size: int = 2,
                grid: tuple[int, int] | None = None, rounds: int = 1,
                initial_coords: Sequence[int] | None = None,
                codec: str = "none", aggregation: str = "mean", local_world: int | None = None,
                local_rank: int | None = None) -> list[torch.Tensor]:
        """Weighted average of `tensors` with the peers averaging under `key`.

        With grid=(M, d), `key` names a run on the Moshpit grid: each call averages with this
        round's line of the grid (groups of up to M), and `rounds=k` chains k rounds, carrying
        weights as mass, so d rounds on a full grid give the exact weighted global mean.
        `codec` (none, fp16, bf16, int8, int4) compresses parts on the wire; peers must agree.
        `aggregation` (mean, trimmed_mean, centered_clip) is how the group combines values:
        the robust ones bound what a minority of bad peers can do; peers must agree.
        `local_world=N`: this is one of N trainers of this host whose daemon averages them as
        one peer; without `local_rank` they are replicas (the daemon averages their weighted
        mean, weighted by their sum), with it the shards of one vector in rank order.
        Returns new tensors (same shapes, dtypes, devices) and leaves the inputs untouched,
        except for tensors made by `share()`: those are averaged in place and returned."""
        tensors = list(tensors)
        check_aggregation(aggregation)
        local_world, local_rank = check_local(local_world, local_rank)
        with self._lock:
            shared = self._shared_layout(tensors)
            device = next((d for d in self._device_shared if d.holds(tensors)), None)
            if shared is not None:  # tensors from share(): averaged where they lie
                bid, specs = shared
                views = tensors
            elif device is not None:  # device tensors from share(): through their buffer
                bid, specs, buf = device.bid, device.specs, device.buf
                views = self._views(buf, specs)
            else:
                specs, size = _layout(tensors)
                bid = 0
                self._ensure_buffer(size)
                assert self._mmap is not None
                buf = self._mmap
                views = self._views(buf, specs)
            # The tensors are copied into the buffer while the daemon looks for a group (a
            # local group's trainers meet first, so theirs go in before they ask)
            pending = shared is None and local_world is None
            if shared is None and not pending:
                self._device.to_buffer(buf, views, tensors)
            request = wire.AverageRequest(
                key=key, tensors=specs, weight=float(weight), timeout=float(timeout),
                group_size=int(group_size), min_group_size=int(min_group_size),
                grid=None if grid is None else [int(grid[0]), int(grid[1])],
                rounds=int(rounds), codec=str(codec), buffer=bid, aggregation=aggregation,
                local_world=local_world, local_rank=local_rank, pending=pending,
                initial_coords=None if initial_coords is None else [int(c) for c in
                                                                    initial_coords])
            if pending:
                reply = self._pending_average(request, buf, views, tensors, timeout)
            else:
                reply = self._call(request, wire.AverageReply, timeout=timeout + REPLY_MARGIN)
            self.last_round = round_info(reply)
            if shared is not None:
                return tensors
            # a CPU result must leave the buffer the next call reuses; a device result is
            # copied from it by DMA (no host copy in between)
            outs = tensors if device is not None else [
                v.clone().reshape(t.shape) if t.device.type != "cuda" else
                torch.empty(t.shape, dtype=t.dtype, device=t.device)
                for v, t in zip(views, tensors, strict=True)]
            self._device.from_buffer(buf, views, outs)
            return outs

    def _pending_average(self, request: wire.AverageRequest, buf: mmap.mmap,
                         views: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor],
                         timeout: float) -> wire.AverageReply:
        """Asks first, then copies the tensors in and says `ready`: the copies (from a GPU,
        on a side stream) overlap the round's matchmaking. A copy that fails abandons the
        request, so the daemon sends nothing of the half-filled buffer."""
        rid = self._conn.send(request, timeout)
        try:
            self._device.to_buffer(buf, views, tensors)
        except BaseException:
            with contextlib.suppress(MoshpitError):  # the copy's error is the one to raise
                self._conn.send(wire.ReadyRequest(request=rid, abandon=True), timeout,
                                awaited=False)
            raise
        self._conn.send(wire.ReadyRequest(request=rid), timeout, awaited=False)
        return decode_reply(request.OP, self._conn.reply(rid, timeout + REPLY_MARGIN),
                            wire.AverageReply)

    def share(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of `tensors` whose values `average` exchanges with the daemon in place.

        CPU tensors: the copies live in memory shared with the daemon, averaged with no copy
        on either side; keep a model's parameters in them (`p.data = shared`) to hand a round
        over for free. CUDA tensors: the copies stay on their device, with a page-locked
        buffer of their own that averaging copies them through, asynchronously."""
        tensors = list(tensors)
        for i, t in enumerate(tensors):
            if isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "cuda"):
                raise TypeError(f"tensor {i} is on {t.device}: share() takes CPU or CUDA "
                                "tensors")
        specs, size = _layout(tensors)
        cuda = on_cuda(tensors)
        if cuda and not all(t.device.type == "cuda" for t in tensors):
            raise TypeError("share() takes tensors all on the CPU or all on CUDA devices, "
                            "not both")
        with self._lock:
            bid = len(self._shared) + len(self._device_shared) + 1
            buf = self._attach(bid, size)
            views = self._views(buf, specs)
            if cuda:
                copies = [t.detach().clone(memory_format=torch.contiguous_format)
                          for t in tensors]
                self._device.pin(buf)
                self._device_shared.append(DeviceShare(bid, buf, specs, copies))
                return copies
            for view, t in zip(views, tensors, strict=True):
                view.copy_(t.detach().reshape(-1))
            self._shared.append((bid, address(buf), len(buf), buf))
        return [v.reshape(t.shape) for v, t in zip(views, tensors, strict=True)]

    def publish_state(self, key: str, tensors: Sequence[torch.Tensor],
                      meta: dict[str, Any] | None = None, version: int | None = None,
                      timeout: float = DEFAULT_TIMEOUT) -> int:
        """Hand the daemon a snapshot of this trainer's state (parameters, optimizer state,
        step...) for peers that join the run later; returns its version. The daemon keeps a
        copy and serves it itself, so downloads never block this trainer. Peers publishing
        the same `version` (e.g. the same step) serve one download together; by default the
        version is the time of publication."""
        tensors = list(tensors)
        with self._lock:
            shared = self._shared_layout(tensors)
            if shared is not None:
                bid, specs = shared
            else:
                specs, size = _layout(tensors)
                bid = 0
                self._ensure_buffer(size)
                assert self._mmap is not None
                self._device.to_buffer(self._mmap, self._views(self._mmap, specs), tensors)
            reply = self._call(wire.PublishStateRequest(
                key=key, tensors=specs, buffer=bid, meta=meta or {}, timeout=float(timeout),
                version=version), wire.PublishStateReply, timeout=timeout + REPLY_MARGIN)
            return reply.version

    def download_state(self, key: str, timeout: float = DEFAULT_TIMEOUT
                       ) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """The latest state published under `key` by peers, downloaded by this daemon from
        several donors at once (a donor that dies mid-way is replaced). Raises
        StateUnavailable if no donor answers within `timeout`."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                info = self._call(wire.StateInfoRequest(key=key, timeout=float(timeout)),
                                  wire.StateInfoReply, timeout=timeout + REPLY_MARGIN)
                self._ensure_buffer(info.total)
                remaining = max(deadline - time.monotonic(), MIN_DOWNLOAD_TIME)
                try:
                    reply = self._call(wire.DownloadStateRequest(
                        key=key, buffer=0, version=info.version, timeout=remaining),
                        wire.DownloadStateReply, timeout=remaining + REPLY_MARGIN)
                    break
                except StateUnavailable:
                    # every holder of that version left meanwhile: a newer one may exist
                    timeout = deadline - time.monotonic()
                    if timeout < MIN_DOWNLOAD_TIME:
                        raise
            self.last_download = {"version": reply.version, "donors": reply.donors,
                                  "served_by": reply.served_by}
            specs = [list(t) for t in reply.tensors]
            views = self._views(self._mmap, specs)
            tensors = [v.clone().reshape(tuple(shape)) for v, (_, shape, _) in
                       zip(views, specs, strict=True)]
            return tensors, dict(reply.meta)

    def close(self) -> None:
        super().close()
        for buf in [self._mmap, *(b for *_, b in self._shared),
                    *(d.buf for d in self._device_shared)]:
            if buf is not None:
                self._device.release(buf)  # before the mapping can go
        self._mmap = None
        self._shared.clear()
        self._device_shared.clear()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ------------------------------------------------------------------------
    @staticmethod
    def _views(buf: mmap.mmap | None, specs: list[list[Any]]) -> list[torch.Tensor]:
        assert buf is not None
        out = []
        for dtype, shape, offset in specs:
            count = int(np.prod(shape)) if shape else 1
            arr = np.frombuffer(buf, dtype=dtype, count=count, offset=offset)
            out.append(torch.from_numpy(arr))
        return out

    def _shared_layout(self, tensors: list[torch.Tensor]) -> tuple[int, list[list[Any]]] | None:
        """(buffer id, specs) when every tensor lies in one buffer made by share()."""
        for bid, base, size, _ in self._shared:
            specs = []
            for t in tensors:
                dtype = _DTYPES.get(t.dtype)
                offset = t.data_ptr() - base
                if (dtype is None or t.device.type != "cpu" or not t.is_contiguous()
                        or not 0 <= offset <= size - t.numel() * t.element_size()):
                    break
                specs.append([dtype, list(t.shape), offset])
            else:
                if tensors:
                    return bid, specs
        return None

    def _ensure_buffer(self, size: int) -> None:
        if self._mmap is not None and self._size >= size:
            return
        size = max(size, 2 * self._size)
        if self._mmap is not None:
            self._device.release(self._mmap)
        self._mmap = self._attach(0, size)  # the old mapping goes when its views do
        self._size = len(self._mmap)

    def _attach(self, bid: int, size: int) -> mmap.mmap:
        """A new memfd, sealed against shrinking (the daemon insists), mapped by both sides."""
        size = max(size, mmap.PAGESIZE)
        size = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        fd = os.memfd_create("moshpit", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
            buf = mmap.mmap(fd, size)
            self._call(wire.AttachRequest(size=size, buffer=bid), wire.AttachReply,
                       timeout=LOCAL_REPLY_TIMEOUT, fd=fd)
        finally:
            os.close(fd)
        return buf

__all__ = ["AGGREGATIONS", "Client", "InvalidRequest", "RoundInfo"]
