"""moshpit.Client: talks to the local moshpitd over its unix socket.

Tensor bytes go through a memfd that both sides map; only small msgpack frames cross the socket.
The buffer is sealed against shrinking (the daemon insists), grown by attaching a new memfd.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moshpit.connection import DaemonConnection, R, decode_reply
from moshpit.errors import (
    InvalidRequest,
    ProtocolError,
    StateUnavailable,
)
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


@dataclass(frozen=True)
class RoundInfo:
    """What the daemon reports about the last averaging round."""

    group_size: int
    seconds: float
    matchmaking_seconds: float
    bytes_sent: int
    bytes_received: int
    round: int | None = None  # the grid round (None without a grid)
    coords: tuple[int, ...] | None = None  # this peer's cell on the grid
    group_sizes: tuple[int, ...] = ()  # one per round of a multi-round call
    # What each element of the result is, for the last all-reduce: (start, stop, members) over
    # the flattened tensors in request order; `members` is a bitmask of the group members whose
    # values were averaged there, 0 where the element kept its local value (a peer failed).
    spans: tuple[tuple[int, int, int], ...] = ()
    members: tuple[str, ...] = ()  # peer ids of the group, bit i of a mask = members[i]
    owned: int = 0  # elements this peer reduced for its group (0 in client mode)
    # With local_world: this trainer's local rank (a replica's is its order of arrival in the
    # round) and the local ranks whose values the host sent (replicas left out are missing)
    local_rank: int | None = None
    local_ranks: tuple[int, ...] = ()

    @property
    def fully_averaged(self) -> bool:
        return all(mask for _, _, mask in self.spans)


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


def _address(buf: mmap.mmap) -> int:
    """Where a mapping starts in memory (to tell whether a tensor lies inside it)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _round_info(reply: wire.AverageReply) -> RoundInfo:
    if any(len(span) != 3 for span in reply.spans):
        raise ProtocolError("average: field 'spans' holds a span that is not [start, stop, "
                            "mask]")
    return RoundInfo(
        group_size=reply.group_size, seconds=reply.seconds,
        matchmaking_seconds=reply.matchmaking_seconds, bytes_sent=reply.bytes_sent,
        bytes_received=reply.bytes_received, round=reply.round,
        coords=None if reply.coords is None else tuple(reply.coords),
        group_sizes=tuple(reply.group_sizes),
        spans=tuple((a, b, m) for a, b, m in reply.spans),
        members=tuple(reply.members), owned=reply.owned, local_rank=reply.local_rank,
        local_ranks=tuple(reply.local_ranks))


class Client:
    """One connection to a daemon. Thread-safe: requests are serialised."""

    def __init__(self, socket_path: str, connect_timeout: float = 5.0) -> None:
        self.socket_path = socket_path
        self._lock = threading.Lock()
        self._conn = DaemonConnection(socket_path, connect_timeout)
        self._mmap: mmap.mmap | None = None
        self._size = 0
        self._shared: list[tuple[int, int, int, mmap.mmap]] = []  # id, address, size, map
        self.last_round: RoundInfo | None = None
        # the last download_state: {"version", "donors" (holders seen), "served_by"}
        self.last_download: dict[str, int] | None = None
        try:
            hello = self._hello(connect_timeout)
        except BaseException:
            self._conn.close()
            raise
        self.peer_id: str = hello.peer_id
        self.daemon_version: str = hello.version

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
            if shared is not None:  # tensors from share(): averaged where they lie
                bid, specs = shared
                views = tensors
            else:
                specs, size = _layout(tensors)
                bid = 0
                self._ensure_buffer(size)
                views = self._views(self._mmap, specs)
                for view, t in zip(views, tensors, strict=True):
                    view.copy_(t.detach().reshape(-1))
            reply = self._call(wire.AverageRequest(
                key=key, tensors=specs, weight=float(weight), timeout=float(timeout),
                group_size=int(group_size), min_group_size=int(min_group_size),
                grid=None if grid is None else [int(grid[0]), int(grid[1])],
                rounds=int(rounds), codec=str(codec), buffer=bid, aggregation=aggregation,
                local_world=local_world, local_rank=local_rank,
                initial_coords=None if initial_coords is None else [int(c) for c in
                                                                    initial_coords],
            ), wire.AverageReply, timeout=timeout + REPLY_MARGIN)
            self.last_round = _round_info(reply)
            if shared is not None:
                return tensors
            # a CPU result must leave the buffer the next call reuses; a device tensor is
            # copied out of it by the transfer itself (no host copy in between)
            return [v.clone().reshape(t.shape) if t.device.type == "cpu" else
                    v.reshape(t.shape).to(t.device) for v, t in zip(views, tensors, strict=True)]

    def share(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of `tensors` that live in memory shared with the daemon.

        `average` averages such tensors in place, with no copy on either side: keep a
        model's parameters in them (`p.data = shared`) to hand a round over for free.
        They live in host memory: CPU tensors only (average() copies device tensors through
        the shared buffer itself)."""
        tensors = list(tensors)
        for i, t in enumerate(tensors):
            if isinstance(t, torch.Tensor) and t.device.type != "cpu":
                raise TypeError(f"tensor {i} is on {t.device}: share() makes tensors in host "
                                "memory shared with the daemon; pass device tensors to "
                                "average() as they are, which copies them through that memory")
        specs, size = _layout(tensors)
        with self._lock:
            bid = len(self._shared) + 1
            buf = self._attach(bid, size)
            views = self._views(buf, specs)
            for view, t in zip(views, tensors, strict=True):
                view.copy_(t.detach().reshape(-1))
            base = _address(buf)
            self._shared.append((bid, base, len(buf), buf))
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
                for view, t in zip(self._views(self._mmap, specs), tensors, strict=True):
                    view.copy_(t.detach().reshape(-1))
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

    def status(self) -> dict[str, Any]:
        """{"status": the daemon's state, "metrics": its /metrics address, "ipc": its socket}."""
        with self._lock:
            return wire.encode(self._call(wire.StatusRequest(), wire.StatusReply,
                                          timeout=LOCAL_REPLY_TIMEOUT))

    def rounds(self) -> list[dict[str, Any]]:
        with self._lock:
            return self._call(wire.RoundsRequest(), wire.RoundsReply,
                              timeout=LOCAL_REPLY_TIMEOUT).rounds

    def peers(self) -> dict[str, Any]:
        """{"contacts": [{peer_id, dht}], "runs": {run: [{peer_id, coords, round, grpc}]}}.
        Waits as long as a request's default timeout: the daemon looks each run up in the
        DHT."""
        with self._lock:
            reply = self._call(wire.PeersRequest(), wire.PeersReply, timeout=DEFAULT_TIMEOUT)
        return {"contacts": reply.contacts, "runs": reply.runs}

    def close(self) -> None:
        self._conn.close()
        self._mmap = None
        self._shared.clear()

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

    def _hello(self, timeout: float) -> wire.HelloReply:
        return self._conn.hello(timeout)

    def _call(self, req: wire.Message, reply: type[R], timeout: float,
              fd: int | None = None) -> R:
        """One request; its reply decoded by field name."""
        return decode_reply(req.OP, self._request(req, timeout=timeout, fd=fd), reply)

    def _request(self, req: wire.Message, timeout: float,
                 fd: int | None = None) -> dict[str, Any]:
        return self._conn.request(req, timeout, fd)

__all__ = ["AGGREGATIONS", "Client", "InvalidRequest", "RoundInfo"]
