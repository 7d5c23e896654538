"""moshpit.Client: talks to the local moshpitd over its unix socket.

Tensor bytes go through a memfd that both sides map; only small msgpack frames cross the socket.
The buffer is sealed against shrinking (the daemon insists), grown by attaching a new memfd.
"""

from __future__ import annotations

import array
import ctypes
import fcntl
import mmap
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from moshpit.errors import (
    DaemonUnavailable,
    InvalidRequest,
    MoshpitError,
    ProtocolError,
    StateUnavailable,
    from_reply,
)

MAX_FRAME = 1 << 20
ALIGN = 64
_DTYPES = {torch.float16: "float16", torch.float32: "float32", torch.float64: "float64"}
# How a group combines its members' values (the daemon's moshpitd/allreduce/robust.py).
AGGREGATIONS = ("mean", "trimmed_mean", "centered_clip")


def check_aggregation(aggregation: str) -> str:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}, not "
                         f"{aggregation!r}")
    return aggregation


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
        offset = (offset + ALIGN - 1) // ALIGN * ALIGN
        specs.append([dtype, list(t.shape), offset])
        offset += t.numel() * t.element_size()
    return specs, max(offset, 1)


def _address(buf: mmap.mmap) -> int:
    """Where a mapping starts in memory (to tell whether a tensor lies inside it)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _round_info(reply: dict[str, Any]) -> RoundInfo:
    coords = reply.get("coords")
    return RoundInfo(
        int(reply["group_size"]), float(reply["seconds"]), float(reply["matchmaking_seconds"]),
        int(reply["bytes_sent"]), int(reply["bytes_received"]), reply.get("round"),
        None if coords is None else tuple(coords), tuple(reply.get("group_sizes", ())),
        tuple((int(a), int(b), int(m)) for a, b, m in reply.get("spans", ())),
        tuple(str(m) for m in reply.get("members", ())), int(reply.get("owned", 0)))


class Client:
    """One connection to a daemon. Thread-safe: requests are serialised."""

    def __init__(self, socket_path: str, connect_timeout: float = 5.0) -> None:
        self.socket_path = socket_path
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(connect_timeout)
        try:
            self._sock.connect(socket_path)
        except OSError as exc:
            self._sock.close()
            raise DaemonUnavailable(f"cannot connect to moshpitd at {socket_path}: {exc}") from exc
        self._mmap: mmap.mmap | None = None
        self._size = 0
        self._shared: list[tuple[int, int, int, mmap.mmap]] = []  # id, address, size, map
        self._next_id = 0
        self.last_round: RoundInfo | None = None
        # the last download_state: {"version", "donors" (holders seen), "served_by"}
        self.last_download: dict[str, int] | None = None
        hello = self._request({"op": "hello"}, timeout=connect_timeout)
        self.peer_id: str = str(hello.get("peer_id", ""))

    # --- public API -----------------------------------------------------------------------
    def average(self, tensors: Sequence[torch.Tensor], key: str, weight: float = 1.0,
                timeout: float = 30.0, group_size: int = 16, min_group_size: int = 2,
                grid: tuple[int, int] | None = None, rounds: int = 1,
                initial_coords: Sequence[int] | None = None,
                codec: str = "none", aggregation: str = "mean") -> list[torch.Tensor]:
        """Weighted average of `tensors` with the peers averaging under `key`.

        With grid=(M, d), `key` names a run on the Moshpit grid: each call averages with this
        round's line of the grid (groups of up to M), and `rounds=k` chains k rounds, carrying
        weights as mass, so d rounds on a full grid give the exact weighted global mean.
        `codec` (none, fp16, bf16, int8) compresses parts on the wire; peers must agree.
        `aggregation` (mean, trimmed_mean, centered_clip) is how the group combines values:
        the robust ones bound what a minority of bad peers can do; peers must agree.
        Returns new tensors (same shapes, dtypes, devices) and leaves the inputs untouched,
        except for tensors made by `share()`: those are averaged in place and returned."""
        tensors = list(tensors)
        check_aggregation(aggregation)
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
            reply = self._request({
                "op": "average", "key": key, "tensors": specs, "weight": float(weight),
                "timeout": float(timeout), "group_size": int(group_size),
                "min_group_size": int(min_group_size),
                "grid": None if grid is None else [int(grid[0]), int(grid[1])],
                "rounds": int(rounds), "codec": str(codec), "buffer": bid,
                "aggregation": aggregation,
                "initial_coords": None if initial_coords is None else [int(c) for c in
                                                                       initial_coords],
            }, timeout=timeout + 10.0)
            self.last_round = _round_info(reply)
            if shared is not None:
                return tensors
            return [v.clone().reshape(t.shape).to(t.device)
                    for v, t in zip(views, tensors, strict=True)]

    def share(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of `tensors` that live in memory shared with the daemon.

        `average` averages such tensors in place, with no copy on either side: keep a
        model's parameters in them (`p.data = shared`) to hand a round over for free."""
        tensors = list(tensors)
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
                      timeout: float = 30.0) -> int:
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
            reply = self._request({"op": "publish_state", "key": key, "tensors": specs,
                                   "buffer": bid, "meta": meta or {}, "timeout": timeout,
                                   "version": version},
                                  timeout=timeout + 10.0)
            return int(reply["version"])

    def download_state(self, key: str, timeout: float = 30.0
                       ) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """The latest state published under `key` by peers, downloaded by this daemon from
        several donors at once (a donor that dies mid-way is replaced). Raises
        StateUnavailable if no donor answers within `timeout`."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                info = self._request({"op": "state_info", "key": key, "timeout": timeout},
                                     timeout=timeout + 10.0)
                self._ensure_buffer(int(info["total"]))
                remaining = max(deadline - time.monotonic(), 0.5)
                try:
                    reply = self._request({"op": "download_state", "key": key, "buffer": 0,
                                           "version": int(info["version"]),
                                           "timeout": remaining}, timeout=remaining + 10.0)
                    break
                except StateUnavailable:
                    # every holder of that version left meanwhile: a newer one may exist
                    timeout = deadline - time.monotonic()
                    if timeout < 0.5:
                        raise
            self.last_download = {"version": int(reply["version"]),
                                  "donors": int(reply["donors"]),
                                  "served_by": int(reply["served_by"])}
            specs = [list(t) for t in reply["tensors"]]
            views = self._views(self._mmap, specs)
            tensors = [v.clone().reshape(tuple(shape)) for v, (_, shape, _) in
                       zip(views, specs, strict=True)]
            return tensors, dict(reply.get("meta", {}))

    def status(self) -> dict[str, Any]:
        with self._lock:
            return self._request({"op": "status"}, timeout=10.0)

    def rounds(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._request({"op": "rounds"}, timeout=10.0)["rounds"])

    def peers(self) -> dict[str, Any]:
        """{"contacts": [{peer_id, dht}], "runs": {run: [{peer_id, coords, round, grpc}]}}."""
        with self._lock:
            reply = self._request({"op": "peers"}, timeout=30.0)
        return {"contacts": reply.get("contacts", []), "runs": reply.get("runs", {})}

    def close(self) -> None:
        self._sock.close()
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
            self._request({"op": "attach", "size": size, "buffer": bid}, timeout=10.0, fd=fd)
        finally:
            os.close(fd)
        return buf

    def _request(self, msg: dict[str, Any], timeout: float,
                 fd: int | None = None) -> dict[str, Any]:
        self._next_id += 1
        rid = self._next_id
        payload = msgpack.packb({**msg, "id": rid}, use_bin_type=True)
        frame = len(payload).to_bytes(4, "big") + payload
        try:
            self._sock.settimeout(timeout)
            if fd is None:
                self._sock.sendall(frame)
            else:
                sent = self._sock.sendmsg(
                    [frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
                )
                if sent < len(frame):
                    self._sock.sendall(frame[sent:])
            deadline = time.monotonic() + timeout
            while True:
                reply = self._read_frame(deadline)
                if reply.get("id") in (rid, None):
                    break
        except TimeoutError as exc:
            raise DaemonUnavailable(f"no reply from moshpitd within {timeout:.1f} s") from exc
        except OSError as exc:
            last = self._last_words()
            if last is not None:  # it said why it went (a drain): raise that, not EPIPE
                raise from_reply(last) from exc
            raise DaemonUnavailable(f"lost the connection to moshpitd: {exc}") from exc
        if not reply.get("ok"):
            raise from_reply(reply)
        return reply

    def _last_words(self) -> dict[str, Any] | None:
        """A frame the daemon sent before closing, if one is waiting unread."""
        try:
            reply = self._read_frame(time.monotonic() + 0.05)
        except (OSError, MoshpitError, ValueError):
            return None
        return reply if reply.get("id") is None and not reply.get("ok") else None

    def _read_frame(self, deadline: float) -> dict[str, Any]:
        head = self._recv_exact(4, deadline)
        size = int.from_bytes(head, "big")
        if size > MAX_FRAME:
            raise ProtocolError(f"reply frame of {size} bytes is too large")
        obj = msgpack.unpackb(self._recv_exact(size, deadline), raw=False)
        if not isinstance(obj, dict):
            raise ProtocolError("reply is not a map")
        return obj

    def _recv_exact(self, n: int, deadline: float) -> bytes:
        chunks, got = [], 0
        while got < n:
            self._sock.settimeout(max(deadline - time.monotonic(), 0.001))
            chunk = self._sock.recv(n - got)
            if not chunk:
                raise DaemonUnavailable("moshpitd closed the connection")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)


__all__ = ["AGGREGATIONS", "Client", "InvalidRequest", "RoundInfo"]
