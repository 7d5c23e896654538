"""DeviceCopier's bookkeeping of page-locked buffers, with CUDA's registration calls replaced:
each mapping is registered once, unregistered before it goes, and a refusal falls back to
staging with one warning. The copies themselves need a GPU (tests/integration, skipped
without one); CPU tensors never touch CUDA."""

from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass, field

import pytest
import torch

from moshpit import device_copy
from moshpit.device_copy import DeviceCopier, address


@dataclass
class FakeCuda:
    """cudaHostRegister/Unregister as DeviceCopier calls them: the calls, and the code
    registering returns."""

    code: int = 0
    registered: list[tuple[int, int]] = field(default_factory=list)
    unregistered: list[int] = field(default_factory=list)

    def register(self, addr: int, size: int) -> int:
        self.registered.append((addr, size))
        return self.code

    def unregister(self, addr: int) -> int:
        self.unregistered.append(addr)
        return 0


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    monkeypatch.setattr(device_copy, "_warned", False)
    monkeypatch.setattr(device_copy, "register", fake.register)
    monkeypatch.setattr(device_copy, "unregister", fake.unregister)
    return fake


def test_a_buffer_is_registered_once_and_unregistered_on_release(
        cuda: FakeCuda) -> None:
    buf = mmap.mmap(-1, 3 * mmap.PAGESIZE)
    copier = DeviceCopier()
    assert copier.pin(buf) and copier.pin(buf)
    assert cuda.registered == [(address(buf), 3 * mmap.PAGESIZE)]
    copier.release(buf)
    assert cuda.unregistered == [address(buf)] and not copier.registered
    copier.release(buf)  # twice: nothing more to undo
    assert len(cuda.unregistered) == 1
    buf.close()  # nothing holds its address any more


def test_a_refused_registration_stages_and_warns_once(
        cuda: FakeCuda, caplog: pytest.LogCaptureFixture) -> None:
    cuda.code = 712
    bufs = [mmap.mmap(-1, mmap.PAGESIZE) for _ in range(2)]
    copier = DeviceCopier()
    with caplog.at_level(logging.WARNING, logger="moshpit"):
        assert not copier.pin(bufs[0]) and not copier.pin(bufs[0])  # asked once per buffer
        assert not DeviceCopier().pin(bufs[1])
    assert len(cuda.registered) == 2
    warnings = [r for r in caplog.records if "pinned staging buffer" in r.message]
    assert len(warnings) == 1 and "error 712" in warnings[0].message
    for buf in bufs:
        copier.release(buf)
    assert cuda.unregistered == []  # never registered: nothing to unregister


def test_cpu_tensors_are_copied_without_cuda(
        cuda: FakeCuda) -> None:
    buf = mmap.mmap(-1, mmap.PAGESIZE)
    views = [torch.frombuffer(buf, dtype=torch.float32, count=4, offset=0),
             torch.frombuffer(buf, dtype=torch.float64, count=3, offset=64)]
    tensors = [torch.arange(4.0).reshape(2, 2), torch.tensor([1.5, -2.0, 3.0],
                                                             dtype=torch.float64)]
    copier = DeviceCopier()
    copier.to_buffer(buf, views, tensors)
    for v, t in zip(views, tensors, strict=True):
        assert torch.equal(v, t.reshape(-1))
    copier.from_buffer(buf, views, [torch.zeros(2, 2), torch.zeros(3, dtype=torch.float64)])
    assert cuda.registered == []
    del views
    buf.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the bench runs")
def test_the_bench_says_there_is_no_cuda_device_and_exits_0(
        capsys: pytest.CaptureFixture[str]) -> None:
    from bench.cuda_copy import main

    assert main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out
