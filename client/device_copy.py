"""CUDA tensors in and out of the buffers shared with the daemon (the daemon never sees CUDA).

A buffer is registered with CUDA (cudaHostRegister: its pages locked) the first time device
tensors go through it, so a copy between a device tensor and its slice of the buffer is a DMA
transfer that runs asynchronously on a side stream. All tensors' copies are queued at once,
tensor by tensor, and overlap each other; the request goes to the daemon once they are done,
and a call returns once the results are back on the device.

Some sandboxes refuse to page-lock a shared mapping. Device tensors then go through a pinned
staging buffer (one more host copy each way), and the log says so once. A buffer is
unregistered before its mapping is dropped.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from collections.abc import Sequence

import torch

log = logging.getLogger("moshpit")
_warned = False  # the staging fallback is logged once per process


def on_cuda(tensors: Sequence[torch.Tensor]) -> bool:
    return any(t.device.type == "cuda" for t in tensors)


def address(buf: mmap.mmap) -> int:
    """Where a mapping starts in memory."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def register(addr: int, size: int) -> int:
    """cudaHostRegister's error code (0: the range is page-locked for CUDA)."""
    return int(torch.cuda.cudart().cudaHostRegister(addr, size, 0))


def unregister(addr: int) -> int:
    return int(torch.cuda.cudart().cudaHostUnregister(addr))


class DeviceCopier:
    """One client's copies between device tensors and its shared buffers. Not thread-safe:
    the client serialises its calls."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # address -> size of each page-locked mapping
        self.refused: set[int] = set()  # addresses CUDA would not register: staged
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._staging: torch.Tensor | None = None

    def pin(self, buf: mmap.mmap) -> bool:
        """Page-lock the mapping (once); False: CUDA refused, device copies are staged."""
        addr = address(buf)
        if addr in self.registered:
            return True
        if addr in self.refused:
            return False
        code = register(addr, len(buf))
        if code == 0:
            self.registered[addr] = len(buf)
            return True
        self.refused.add(addr)
        global _warned
        if not _warned:
            _warned = True
            log.warning("moshpit: CUDA refused to page-lock the buffer shared with moshpitd "
                        "(cudaHostRegister error %d); device tensors are copied through a "
                        "pinned staging buffer instead, one more host copy each way", code)
        return False

    def release(self, buf: mmap.mmap) -> None:
        """Before the mapping is dropped or closed: unregister it."""
        addr = address(buf)
        self.refused.discard(addr)
        if self.registered.pop(addr, None) is not None:
            code = unregister(addr)
            if code != 0:
                log.warning("moshpit: cudaHostUnregister failed with error %d", code)

    def to_buffer(self, buf: mmap.mmap, views: Sequence[torch.Tensor],
                  tensors: Sequence[torch.Tensor]) -> None:
        """Each tensor into its flat view of the buffer; done when this returns."""
        staged = []
        for view, t in zip(views, tensors, strict=True):
            if t.device.type == "cuda":
                staged.append((view, t.detach().reshape(-1)))
            else:
                view.copy_(t.detach().reshape(-1))
        if not staged:
            return
        pinned = self.pin(buf)
        base = address(buf)
        streams = []
        for device in {t.device for _, t in staged}:  # all queued, then all waited for
            with self._side_stream(device) as stream:
                for view, t in staged:
                    if t.device == device:
                        dest = view if pinned else self._stage(base, view, len(buf))
                        dest.copy_(t, non_blocking=True)
            streams.append(stream)
        for stream in streams:
            stream.synchronize()
        if not pinned:
            for view, _ in staged:
                view.copy_(self._stage(base, view, len(buf)))

    def from_buffer(self, buf: mmap.mmap, views: Sequence[torch.Tensor],
                    outs: Sequence[torch.Tensor]) -> None:
        """Each device tensor of `outs` (contiguous) from its view; done when this returns."""
        pairs = [(v, o) for v, o in zip(views, outs, strict=True) if o.device.type == "cuda"]
        if not pairs:
            return
        pinned = self.pin(buf)
        base = address(buf)
        streams = []
        for device in {o.device for _, o in pairs}:
            with self._side_stream(device) as stream:
                for view, out in pairs:
                    if out.device != device:
                        continue
                    src = view
                    if not pinned:
                        src = self._stage(base, view, len(buf))
                        src.copy_(view)
                    out.view(-1).copy_(src, non_blocking=True)
            streams.append(stream)
        for stream in streams:
            stream.synchronize()

    def _side_stream(self, device: torch.device) -> _OnSideStream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return _OnSideStream(stream)

    def _stage(self, base: int, view: torch.Tensor, size: int) -> torch.Tensor:
        """The pinned staging buffer's slice at the view's offset in its buffer."""
        if self._staging is None or self._staging.numel() < size:
            self._staging = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        offset = view.data_ptr() - base
        nbytes = view.numel() * view.element_size()
        return self._staging[offset:offset + nbytes].view(view.dtype)


class _OnSideStream:
    """Queue work on a side stream after what the current stream has queued so far (the
    tensors' producers, and earlier users of memory the allocator hands out again)."""

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.stream = stream
        self._ctx = torch.cuda.stream(stream)

    def __enter__(self) -> torch.cuda.Stream:
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        self._ctx.__enter__()
        return self.stream

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)
