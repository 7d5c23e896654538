"""DDP: torch DistributedDataParallel over gloo, gradients all-reduced in every step. Two rows:
`ddp` (float32 gradients, DDP's default hook) and `ddp-fp16` (torch's `fp16_compress_hook`:
each bucket cast to float16 for the all-reduce and back, half the bytes, what a DDP user on a
slow link turns on first).

What its users do on preemption (torchrun elastic) is the orchestrator's part: it kills every
worker of the world and restarts the survivors from the last checkpoint with a new world
(ddp.world, ddp.generation, ddp.master, ddp.resume), and again when the host returns.

Knobs (torch's defaults, nothing tuned):
- DistributedDataParallel with its defaults (25 MB buckets: this model's gradients are one
  bucket, all-reduced as the backward pass ends); the comm hook is the row's (above).
- `timeout_s` (knob, default 60): init_process_group's timeout, how long a collective waits
  for a silent peer before it fails.
- `sync` per step: `seconds` is the time from the moment the (only, at this model's size)
  gradient bucket goes to all-reduce until backward returns with it reduced, i.e. the
  communication the step waited for (plus any wait for the stop flag below); `step_seconds`
  is the whole step.
- checkpoint every ddp.checkpoint_every_s (the orchestrator's choice, 30 s by default): rank 0
  writes the model, the optimizer, the step and every host's sample count into shared_dir.

All ranks stop after the same step: each step also all-reduces (MAX) a one-element flag "my
clock passed the deadline", issued before the forward pass on a process group of its own, so
its latency overlaps compute and it never queues behind the gradients.
Gloo binds the interface that holds this host's IP (GLOO_SOCKET_IFNAME).
"""

from __future__ import annotations

import datetime
import fcntl
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
    allreduce_hook,
    fp16_compress_hook,
)
from torch.nn.parallel import DistributedDataParallel

from bench.swarm.worker import Events, LocalTrainer, WorkerSpec

SIOCGIFADDR = 0x8915
HOOKS = {"ddp": allreduce_hook, "ddp-fp16": fp16_compress_hook}  # DDP's comm hook per row


def interface_of(ip: str) -> str:
    """The name of the network interface whose IPv4 address is `ip`."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(probe.fileno(), SIOCGIFADDR,
                                  struct.pack("256s", name[:15].encode()))
            except OSError:
                continue  # no IPv4 address
            if socket.inet_ntoa(raw[20:24]) == ip:
                return name
    finally:
        probe.close()
    raise RuntimeError(f"no network interface holds {ip}")


def load_checkpoint(path: str) -> dict[str, Any]:
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise RuntimeError(f"{path} is not a checkpoint of this benchmark")
    return ckpt


def run(spec: WorkerSpec, events: Events) -> None:
    ddp_spec = spec.ddp
    assert ddp_spec is not None  # WorkerSpec.validate
    rank, world = ddp_spec.world.index(spec.host), len(ddp_spec.world)
    os.environ["GLOO_SOCKET_IFNAME"] = interface_of(spec.ip)
    by_host: dict[str, int] = {}
    step = 0
    ckpt = load_checkpoint(ddp_spec.resume) if ddp_spec.resume else None
    if ckpt is not None:
        by_host = {str(k): int(v) for k, v in ckpt["samples_by_host"].items()}
        step = int(ckpt["step"])
    trainer = LocalTrainer(spec, events, step=step, samples=by_host.get(str(spec.host), 0))
    if ckpt is not None:
        trainer.model.load_state_dict(ckpt["model"])
        trainer.optimizer.load_state_dict(ckpt["optimizer"])
    for h in ddp_spec.world:
        by_host.setdefault(str(h), 0)
    timeout = datetime.timedelta(seconds=float(spec.knob("timeout_s", 60.0)))
    dist.init_process_group("gloo", init_method=f"tcp://{ddp_spec.master}", rank=rank,
                            world_size=world, timeout=timeout)
    ddp = DistributedDataParallel(trainer.model)  # broadcasts rank 0's (identical) weights
    launched: list[float] = []  # when this step's first gradient bucket went to all-reduce

    # Unannotated: DDP checks the annotations against dist.GradBucket, and with
    # `from __future__ import annotations` they would be strings.
    hook = HOOKS[spec.system]

    def timed_allreduce(group, bucket):  # type: ignore[no-untyped-def]
        if not launched:
            launched.append(time.perf_counter())
        return hook(group, bucket)  # the mean of the buckets (in float16 for ddp-fp16)

    ddp.register_comm_hook(None, timed_allreduce)
    flags = dist.new_group(backend="gloo")  # its own connections: never queues behind gradients
    trainer.wait_for_start()
    flag = torch.zeros(1)
    next_ckpt = time.time() + ddp_spec.checkpoint_every_s
    while True:
        flag[0] = 1.0 if trainer.time_left() <= 0 else 0.0
        stop = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=flags, async_op=True)
        t0 = time.perf_counter()
        launched.clear()
        trainer.compute_loss(ddp)  # backward returns once the gradients are all-reduced
        waited = time.perf_counter() - launched[0] if launched else 0.0
        trainer.optimizer.step()
        for h in ddp_spec.world:
            by_host[str(h)] += spec.batch
        trainer.advance()
        t1 = time.perf_counter()
        stop.wait()
        waited += time.perf_counter() - t1  # the flag's latency, where compute did not hide it
        stopping = flag.item() > 0
        events.emit("sync", ok=True, group_size=world, seconds=waited,
                    step_seconds=time.perf_counter() - t0)
        if rank == 0 and time.time() >= next_ckpt and not stopping:
            next_ckpt = time.time() + ddp_spec.checkpoint_every_s
            save_checkpoint(spec, trainer, by_host, ddp_spec.generation)
        if stopping:
            break
    trainer.end_of_budget()
    trainer.snapshot("done")
    dist.destroy_process_group()


def save_checkpoint(spec: WorkerSpec, trainer: LocalTrainer, by_host: dict[str, int],
                    generation: int) -> Path:
    """Written to a temporary name and renamed, so a kill mid-write leaves no torn file."""
    path = spec.shared_dir / f"ddp-ckpt-g{generation}-s{trainer.step:07d}.pt"
    tmp = path.with_suffix(".tmp")
    spec.shared_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
                "step": trainer.step, "samples_by_host": dict(by_host),
                "generation": generation, "time": time.time()}, tmp)
    os.replace(tmp, path)
    trainer.events.emit("checkpoint", step=trainer.step, samples=trainer.samples,
                        samples_by_host=dict(by_host), path=str(path))
    return path
