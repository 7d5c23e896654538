"""`python -m bench.cuda_copy`: device-to-host and host-to-device copies of CUDA tensors into
the buffer shared with moshpitd (a memfd mapping), as moshpit.Client makes them.

- registered: the mapping page-locked for CUDA, each tensor copied with non_blocking=True on
  a side stream, all queued before one synchronize (client/device_copy.py);
- staged: the fallback when CUDA refuses to register the mapping, through a pinned buffer;
- pageable: a plain synchronous copy into the unregistered mapping (the path before).

Then one real round between two daemons, trainer A with CUDA tensors and trainer B with CPU
ones, against the same round with CPU tensors on both: what the copies add to a round, and
the share of their standalone time that a round hides. Without a CUDA device it says so and
exits 0.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

import moshpit
from bench.allreduce import parse_elems
from bench.cli import exit_on_sigterm, positive, print_columns
from moshpit.device_copy import DeviceCopier, address
from moshpitd.ipc.schema import aligned
from moshpitd.launcher import LocalSwarm


def memfd_buffer(nbytes: int) -> mmap.mmap:
    """A mapping like the client's shared buffer."""
    size = (max(nbytes, 1) + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
    fd = os.memfd_create("bench-cuda", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def flat_views(buf: mmap.mmap, sizes: list[int]) -> list[torch.Tensor]:
    views, offset = [], 0
    for n in sizes:
        offset = aligned(offset)
        views.append(torch.frombuffer(buf, dtype=torch.float32, count=n, offset=offset))
        offset += 4 * n
    return views


def best(fn: Callable[[], None], repeat: int) -> float:
    """Seconds of the fastest of `repeat` runs (after one to warm up)."""
    fn()
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def time_path(path: str, tensors: list[torch.Tensor], outs: list[torch.Tensor],
              repeat: int) -> tuple[float, float]:
    """(device-to-host s, host-to-device s) of one path, the copies checked."""
    buf = memfd_buffer(aligned(sum(aligned(4 * t.numel()) for t in tensors)))
    views = flat_views(buf, [t.numel() for t in tensors])
    copier = DeviceCopier()
    if path == "staged":
        copier.refused.add(address(buf))  # as if CUDA had refused to register it
    elif path == "registered" and not copier.pin(buf):
        print("CUDA refused to register the memfd mapping here: 'registered' is staged")

    def d2h() -> None:
        if path != "pageable":
            copier.to_buffer(buf, views, tensors)
            return
        for v, t in zip(views, tensors, strict=True):
            v.copy_(t)

    def h2d() -> None:
        if path != "pageable":
            copier.from_buffer(buf, views, outs)
            return
        for o, v in zip(outs, views, strict=True):
            o.copy_(v)

    took = best(d2h, repeat), best(h2d, repeat)
    assert all(torch.equal(o, t) for o, t in zip(outs, tensors, strict=True))
    copier.release(buf)  # before the mapping goes
    return took


def bandwidth(sizes: list[int], repeat: int) -> dict[str, tuple[float, float]]:
    """{path: (device-to-host s, host-to-device s)} for tensors of `sizes` float32."""
    tensors = [torch.randn(n, device="cuda") for n in sizes]
    outs = [torch.empty_like(t) for t in tensors]
    return {path: time_path(path, tensors, outs, repeat)
            for path in ("registered", "staged", "pageable")}


def round_seconds(sizes: list[int], repeat: int, cuda: bool) -> float:
    """Median seconds of trainer A's Client.average in a round with trainer B (2 daemons)."""
    with LocalSwarm(2) as swarm:
        clients = [moshpit.Client(s) for s in swarm.sockets]
        given = [[torch.randn(n, device="cuda" if cuda and i == 0 else "cpu") for n in sizes]
                 for i in range(2)]
        seconds = []
        with ThreadPoolExecutor(2) as pool:
            for r in range(repeat + 1):  # the first round warms up
                def call(i: int, r: int = r) -> float:
                    start = time.perf_counter()
                    clients[i].average(given[i], key=f"copy-{r}", timeout=60)
                    return time.perf_counter() - start
                took = list(pool.map(call, range(2)))
                if r:
                    seconds.append(took[0])
        for c in clients:
            c.close()
    return statistics.median(seconds)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cuda_copy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--elems", type=parse_elems, default=64 << 20, metavar="E",
                   help="float32 elements in all (default 64M: 256 MiB)")
    p.add_argument("--tensors", type=positive, default=16, help="tensors they are cut in (16)")
    p.add_argument("--repeat", type=positive, default=5, help="timed runs of each (5)")
    p.add_argument("--round-elems", type=parse_elems, default=16 << 20, metavar="E",
                   help="float32 elements of the round (default 16M); 0: no round")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device (torch.cuda.is_available() is false): nothing to measure here")
        return 0
    exit_on_sigterm()
    sizes = [a.elems // a.tensors] * a.tensors
    gb = 4 * sum(sizes) / 1e9
    results = bandwidth(sizes, a.repeat)
    base_d2h, base_h2d = results["pageable"]
    cells = [["path", "D2H GB/s", "H2D GB/s", "D2H x pageable", "H2D x pageable"]]
    for path, (d2h, h2d) in results.items():
        cells.append([path, f"{gb / d2h:.1f}", f"{gb / h2d:.1f}", f"{base_d2h / d2h:.2f}",
                      f"{base_h2d / h2d:.2f}"])
    print(f"{torch.cuda.get_device_name()}: {gb * 1e3:.0f} MB in {a.tensors} tensors, "
          f"best of {a.repeat}")
    print_columns(cells)
    if a.round_elems:
        sizes = [a.round_elems // a.tensors] * a.tensors
        copies = sum(bandwidth(sizes, a.repeat)["registered"])
        on_cpu = round_seconds(sizes, a.repeat, cuda=False)
        on_cuda = round_seconds(sizes, a.repeat, cuda=True)
        added = on_cuda - on_cpu
        print(f"round of {4 * sum(sizes) / 1e6:.0f} MB: {on_cpu:.3f} s with CPU tensors, "
              f"{on_cuda:.3f} s with CUDA tensors (+{added:.3f} s); the copies alone take "
              f"{copies:.3f} s, so the round hides {max(1 - added / copies, 0.0):.0%} of them")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
