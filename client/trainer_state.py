"""A trainer's tensors as peers see them: stable names, and the state joiners download.

Names are `param.<i>` (param_groups order), `buffer.<name>` (the model's float buffers) and
`state.<i>.<key>` (the optimizer's per-parameter state): the same on every peer, so averaged
lists line up and a downloaded state lands in the right tensors.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from moshpit.client import Client, RoundInfo
from moshpit.errors import MoshpitError
from moshpitd.ipc.schema import DEFAULT_TIMEOUT

WIRE_DTYPES = (torch.float16, torch.float32, torch.float64)
# Integer-valued counters: averaging them would be meaningless (Adam's bias correction must
# follow this peer's own step count), so they stay local. A joiner still downloads them.
LOCAL_STATE_KEYS = frozenset({"step"})


# Second moments and variances: never negative. In overlap mode a local decay since the snapshot
# plus a smaller group average could push them below zero (NaN in Adam's sqrt), so they are
# clamped at 0 after the delta. Matched as name suffixes (state.<i>.<key>, buffer.<name>).
_NON_NEGATIVE = ("exp_avg_sq", "square_avg", "acc_delta", ".sum", "exp_inf", "running_var")


class AveragingClient(Protocol):
    """What the optimizer needs from a client (moshpit.Client, or a fake in tests)."""

    last_round: RoundInfo | None

    def average(self, tensors: Sequence[torch.Tensor], key: str, weight: float = 1.0,
                timeout: float = DEFAULT_TIMEOUT, group_size: int = 16, min_group_size: int = 2,
                grid: tuple[int, int] | None = None, rounds: int = 1,
                initial_coords: Sequence[int] | None = None,
                codec: str = "none", aggregation: str = "mean", local_world: int | None = None,
                local_rank: int | None = None) -> list[torch.Tensor]: ...

    def share(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]: ...


@dataclass
class PendingRound:
    """A round running in the background (overlap mode)."""

    future: Future[tuple[list[torch.Tensor], RoundInfo | None]]
    names: list[str]
    snapshot: list[torch.Tensor]  # private copies of the tensors at launch, never shared
    samples: int  # the weight sent: subtracted from the sample count once the round succeeds


def named_tensors(optimizer: torch.optim.Optimizer, model: nn.Module | None,
                  state: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters, float buffers, then optimizer state: none, "averaged" (float tensors but
    step counters) or "all" (every tensor of a wire dtype, step counters included)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for i, p in enumerate(params):
        yield f"param.{i}", p
    if model is not None:
        for name, buf in model.named_buffers():
            if buf.is_floating_point():
                yield f"buffer.{name}", buf
    if state == "none":
        return
    for i, p in enumerate(params):
        values = optimizer.state.get(p, {})
        for k in sorted(values, key=str):
            v = values[k]
            if not isinstance(v, torch.Tensor) or v.numel() == 0:
                continue
            if state == "all":
                wanted = v.dtype in WIRE_DTYPES
            else:
                wanted = str(k) not in LOCAL_STATE_KEYS and v.is_floating_point()
            if wanted:
                yield f"state.{i}.{k}", v


def load_named(optimizer: torch.optim.Optimizer, model: nn.Module | None, names: list[Any],
               tensors: list[torch.Tensor]) -> None:
    """Copy a downloaded state into this trainer's parameters, buffers and optimizer state."""
    if len(names) != len(tensors):
        raise MoshpitError("the downloaded state does not describe its tensors")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    buffers = dict(model.named_buffers()) if model is not None else {}
    with torch.no_grad():
        for name, value in zip(names, tensors, strict=True):
            kind, _, rest = str(name).partition(".")
            if kind == "state":
                index, _, key = rest.partition(".")
                param = params[int(index)]
                optimizer.state[param][key] = value.clone().to(param.device)
                continue
            target = params[int(rest)] if kind == "param" else buffers.get(rest)
            if target is None or target.shape != value.shape:
                raise MoshpitError(f"downloaded {name} does not fit this model")
            target.copy_(value)


def stays_non_negative(name: str) -> bool:
    """Whether the averaged tensor `name` (state.<i>.<key>, buffer.<name>) is a variance."""
    return not name.startswith("param.") and name.endswith(_NON_NEGATIVE)


def wire_dtype(t: torch.Tensor) -> torch.dtype:
    return t.dtype if t.dtype in WIRE_DTYPES else torch.float32


def apply_delta(tensors: list[torch.Tensor], snapshot: list[torch.Tensor],
                averaged: list[torch.Tensor], names: list[str]) -> None:
    """t += averaged - snapshot (overlap mode); variances and second moments are clamped at 0
    (see _NON_NEGATIVE)."""
    with torch.no_grad():
        for t, s, a, name in zip(tensors, snapshot, averaged, names, strict=True):
            t.add_(a.to(device=s.device, dtype=s.dtype) - s)
            if stays_non_negative(name):
                t.clamp_(min=0)


def publish(client: Client, key: str, optimizer: torch.optim.Optimizer, model: nn.Module | None,
            local_step: int, timeout: float) -> int:
    """Snapshot everything a joiner needs (step counters included) to the daemon."""
    named = list(named_tensors(optimizer, model, "all"))
    return client.publish_state(key, [t.detach() for _, t in named],
                                {"names": [n for n, _ in named], "local_step": local_step},
                                version=max(local_step, 1), timeout=timeout)


def download(client: Client, key: str, optimizer: torch.optim.Optimizer,
             model: nn.Module | None, timeout: float) -> int:
    """Load the swarm's latest published state; returns the local step it was taken at."""
    tensors, meta = client.download_state(key, timeout=timeout)
    names = meta.get("names")
    load_named(optimizer, model, names if isinstance(names, list) else [], tensors)
    return int(meta.get("local_step", 0))
