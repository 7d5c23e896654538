"""DiLoCo's outer loop (arXiv 2311.08105; Streaming DiLoCo, arXiv 2501.18512).

Every H local steps each fragment's pseudo-gradient, global - local, is averaged with the peers
(weighted by samples), placed in .grad of the global copy and stepped by the outer optimizer;
local weights then restart from the new global copy (or mix with it: mix*local +
(1 - mix)*global). The global copy and the outer optimizer's state live on the CPU; they are
what joiners download. With `delay` the round runs in the background while inner steps go on,
and its update lands `delay` steps after it started. A trainer that joined
(load_state_from_peers) syncs with weight 0 until it has H steps of its own: it takes the mean
and steps like everyone, adds nothing to it, and its daemon owns no span, so nobody waits for
it. A group whose weights are all 0 skips its round, and then nobody steps.

The outer optimizer is the user's, built over the model's parameters (the torchft / OpenDiLoCo
convention): its parameter groups are pointed at the global copy once, here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from moshpit.client import Client, RoundInfo
from moshpit.error_feedback import ErrorFeedback, wire_values
from moshpit.errors import MoshpitError
from moshpit.fragments import FragmentSchedule, split_fragments
from moshpit.trainer_state import WIRE_DTYPES
from moshpitd.allreduce.codecs import get_codec

log = logging.getLogger("moshpit.optimizer")

RoundFuture = Future[tuple[list[torch.Tensor], RoundInfo | None]]
# (key, tensors, weight, overrides of Client.average's arguments) -> a round running, or None
Submit = Callable[[str, list[torch.Tensor], float, dict[str, Any]], RoundFuture | None]


@dataclass(frozen=True)
class OuterConfig:
    every: int  # H
    fragments: int = 1  # P
    delay: int = 0  # steps between a fragment's sync and its update
    mix: float = 0.0  # alpha: local weights after an update = alpha*local + (1 - alpha)*global
    codec: str = "none"
    error_feedback: bool | None = None  # None: on for the codecs below 16 bits

    def __post_init__(self) -> None:
        if not 0 <= self.delay < self.every:
            raise ValueError(f"delay must be >= 0 and below average_every ({self.every}), so a "
                             f"fragment is updated before its next sync; not {self.delay}")
        if not 0.0 <= self.mix <= 1.0:
            raise ValueError(f"mix must be between 0 and 1, not {self.mix}")

    @property
    def feedback(self) -> bool:
        if self.error_feedback is None:
            return self.codec in ("int8", "int4")
        return self.error_feedback


@dataclass
class PendingSync:
    fragments: list[int]
    indices: list[int]  # the parameters it syncs
    future: RoundFuture
    apply_at: int  # local step
    samples: int  # the sample count when it started
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    weight: float = 1.0


def master_copy(p: torch.Tensor) -> torch.Tensor:
    """A CPU copy the outer optimizer steps: float32 for half-precision parameters."""
    dtype = torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype
    return p.detach().to(device="cpu", dtype=dtype, copy=True).requires_grad_(True)


def rebind(outer: torch.optim.Optimizer, params: list[torch.Tensor],
           copies: list[torch.Tensor]) -> None:
    """Points the outer optimizer's groups (and any state it has) at the global copy."""
    index = {id(p): i for i, p in enumerate(params)}
    theirs = [p for group in outer.param_groups for p in group["params"]]
    if sorted(index.get(id(p), -1) for p in theirs) != list(range(len(params))):
        raise ValueError("outer_optimizer must be over the same parameters as the optimizer "
                         "it wraps, e.g. torch.optim.SGD(model.parameters(), lr=0.7, "
                         "momentum=0.9, nesterov=True)")
    for group in outer.param_groups:
        group["params"] = [copies[index[id(p)]] for p in group["params"]]
    for p in theirs:
        if p in outer.state:
            outer.state[copies[index[id(p)]]] = outer.state.pop(p)


class OuterLoop:
    def __init__(self, inner: torch.optim.Optimizer, outer: torch.optim.Optimizer,
                 config: OuterConfig, key: str, grid: tuple[int, int] | None, *,
                 submit: Submit, failed: Callable[[MoshpitError, str], None],
                 succeeded: Callable[[int, RoundInfo | None], None]) -> None:
        self.config = config
        self.params = [p for group in inner.param_groups for p in group["params"]]
        self.schedule = FragmentSchedule(config.every, config.fragments)
        self.fragments = split_fragments([p.numel() for p in self.params], config.fragments)
        self.global_params = [master_copy(p) for p in self.params]
        rebind(outer, self.params, self.global_params)
        self.outer = outer
        self.feedback = ErrorFeedback(config.codec) if config.feedback else None
        self.codec = get_codec(config.codec)
        self.key, self.grid = key, grid
        self.submit, self.failed, self.succeeded = submit, failed, succeeded
        self.samples = 0  # seen in all
        self.synced = [0] * config.fragments  # `samples` at each fragment's last sync
        self.coords: tuple[int, ...] | None = None  # every fragment's run at the same cell
        self.pending: dict[int, PendingSync] = {}
        self.started = False  # the global copy is taken again just before the first step
        self.step = 0  # the local step
        self.joined_at: int | None = None  # the step load_state_from_peers resumed at

    def key_of(self, fragment: int) -> str:
        return self.key if self.config.fragments == 1 else f"{self.key}/f{fragment}"

    # --- the schedule -----------------------------------------------------------------------
    def before_step(self) -> None:
        """The global copy starts from the weights the first step starts from: weights loaded
        after the optimizer was built (a checkpoint, say) are not taken for local progress."""
        if not self.started:
            self.started = True
            with torch.no_grad():
                for g, p in zip(self.global_params, self.params, strict=True):
                    g.copy_(p.detach().to(device="cpu", dtype=g.dtype))

    def after_step(self, step: int, batch_size: int) -> None:
        """Applies the updates due at `step`, then starts the syncs due at it."""
        self.samples += batch_size
        self.step = step
        for p in sorted(p for p, s in self.pending.items() if s.apply_at <= step):
            self._apply(self.pending.pop(p), f"fragment {p}")
        for p in self.schedule.due(step):
            overrides: dict[str, Any] = {"rounds": self.grid[1] if self.grid else 1}
            if self.coords is not None:
                overrides["initial_coords"] = self.coords
            started = self._start([p], self.key_of(p), step + self.config.delay, overrides)
            if started is not None:
                self.pending[p] = started
                if self.config.delay == 0:
                    self._apply(self.pending.pop(p), f"fragment {p}")

    def finish(self) -> None:
        """Applies every update in flight now (waiting for its round)."""
        for p in sorted(self.pending):
            self._apply(self.pending.pop(p), f"fragment {p}")

    def sync_all(self, args: dict[str, Any]) -> bool:
        """An outer step of every fragment at once, blocking (Optimizer.sync)."""
        self.finish()
        args = dict(args)
        started = self._start(list(range(self.config.fragments)), args.pop("key"), 0, args)
        return started is not None and self._apply(started, "every fragment")

    # --- one sync -----------------------------------------------------------------------------
    def pseudo_gradients(self, indices: list[int]) -> list[torch.Tensor]:
        """global - local, on the CPU in the global copy's dtype."""
        with torch.no_grad():
            return [self.global_params[i].detach()
                    - self.params[i].detach().to(device="cpu",
                                                 dtype=self.global_params[i].dtype)
                    for i in indices]

    def _start(self, fragments: list[int], key: str, apply_at: int,
               overrides: dict[str, Any]) -> PendingSync | None:
        indices = [i for p in fragments for i in self.fragments[p]]
        values = self.pseudo_gradients(indices)
        residuals: dict[int, torch.Tensor] = {}
        weight = float(max(self.samples - min(self.synced[p] for p in fragments), 1))
        if self.joined_at is not None and self.step - self.joined_at < self.config.every:
            weight = 0.0  # a joiner's first H steps: it takes the mean, adds nothing to it
        elif self.feedback is not None:
            values, residuals = self.feedback.compress(indices, values)
        future = self.submit(key, values, weight, overrides)
        if future is None:  # no daemon: counted as a failed round already
            return None
        return PendingSync(fragments, indices, future, apply_at, self.samples, residuals,
                           weight)

    def _apply(self, sync: PendingSync, what: str) -> bool:
        """The outer step on the averaged pseudo-gradients; a failed round changes nothing
        (the next pseudo-gradient still holds everything since the last sync)."""
        try:
            out, info = sync.future.result()
        except MoshpitError as exc:
            self.failed(exc, f"outer round of {what} failed, keeping the global copy")
            return False
        if info is not None and info.spans and not any(mask for _, _, mask in info.spans):
            # skipped (every weight in the group was 0): no mean, so no outer step either
            log.info("outer round of %s skipped: every weight in its group was 0", what)
            return False
        if sync.weight == 0 and info is not None and not info.fully_averaged:
            # where the mean did not reach us we hold our own values, which count for nothing
            self.failed(MoshpitError("part of the mean did not reach this trainer"),
                        f"outer round of {what} (weight 0) incomplete, keeping the global copy")
            return False
        if self.codec.name != "none":
            # The owner of a span keeps its exact mean; the others receive it compressed.
            # Compressed once more here (the codecs are idempotent), it is the same on every
            # member, so the global copies do not drift apart.
            out = wire_values(out, self.codec)
        mix = self.config.mix
        with torch.no_grad():
            for g in self.global_params:
                g.grad = None
            for i, avg in zip(sync.indices, out, strict=True):
                g = self.global_params[i]
                g.grad = avg.detach().to(dtype=g.dtype, copy=True).reshape(g.shape)
            self.outer.step()
            for i in sync.indices:
                g, p = self.global_params[i], self.params[i]
                g.grad = None
                new = g.detach().to(device=p.device, dtype=p.dtype)
                if mix:
                    p.mul_(mix).add_(new, alpha=1.0 - mix)
                else:
                    p.copy_(new)
        if self.feedback is not None:
            self.feedback.commit(sync.residuals)
        for p in sync.fragments:
            self.synced[p] = sync.samples
        if info is not None and info.coords is not None:
            self.coords = info.coords
        self.succeeded(0, info)  # the weights are counted per fragment, here
        return True

    # --- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"global": [g.detach().clone() for g in self.global_params],
                "outer": self.outer.state_dict(), "samples": self.samples,
                "synced": list(self.synced), "step": self.step, "joined_at": self.joined_at,
                "residuals": dict(self.feedback.residual) if self.feedback else {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pending.clear()
        self.started = True
        with torch.no_grad():
            for g, v in zip(self.global_params, state["global"], strict=True):
                g.copy_(v)
        self.outer.load_state_dict(state["outer"])
        self.samples, self.synced = int(state["samples"]), [int(s) for s in state["synced"]]
        self.step, self.joined_at = int(state.get("step", 0)), state.get("joined_at")
        if self.feedback is not None:
            self.feedback.residual = dict(state.get("residuals", {}))

    def named_state(self) -> tuple[list[str], list[torch.Tensor]]:
        """`global.<i>` then `outer.<i>.<key>`: what donors serve and joiners load."""
        names = [f"global.{i}" for i in range(len(self.global_params))]
        tensors = [g.detach() for g in self.global_params]
        for i, g in enumerate(self.global_params):
            for k, v in sorted(self.outer.state.get(g, {}).items(), key=lambda kv: str(kv[0])):
                if isinstance(v, torch.Tensor) and v.dtype in WIRE_DTYPES:
                    names.append(f"outer.{i}.{k}")
                    tensors.append(v.detach().cpu())
        return names, tensors

    def publish(self, client: Any, key: str, local_step: int, timeout: float) -> int:
        names, tensors = self.named_state()
        return int(client.publish_state(key, tensors, {"names": names, "local_step": local_step,
                                                       "diloco": 1},
                                        version=max(local_step, 1), timeout=timeout))

    def download(self, client: Client, key: str, timeout: float) -> int:
        """Loads the swarm's global copy and outer state; local weights start from it."""
        tensors, meta = client.download_state(key, timeout=timeout)
        names = meta.get("names")
        if not meta.get("diloco") or not isinstance(names, list) or len(names) != len(tensors):
            raise MoshpitError("the state peers serve is not a DiLoCo global copy (do they "
                               "run with an outer_optimizer?)")
        with torch.no_grad():
            for name, value in zip(names, tensors, strict=True):
                kind, _, rest = str(name).partition(".")
                index, _, state_key = rest.partition(".")
                g = self.global_params[int(index)]
                if kind == "global":
                    if g.shape != value.shape:
                        raise MoshpitError(f"downloaded {name} does not fit this model")
                    g.copy_(value)
                elif kind == "outer":
                    self.outer.state[g][state_key] = value.clone()
            for p, g in zip(self.params, self.global_params, strict=True):
                p.copy_(g)
        self.pending.clear()
        self.started = True
        self.synced = [self.samples] * self.config.fragments
        self.step = self.joined_at = int(meta.get("local_step", 0))
        if self.feedback is not None:  # what it held belongs to another global copy
            self.feedback.residual = {}
        return self.joined_at
