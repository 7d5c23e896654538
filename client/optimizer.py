"""moshpit.Optimizer: Moshpit SGD (Ryabinin et al. 2021, Algorithm 2) around any torch optimizer.

Every `average_every` local steps the parameters (optionally buffers and optimizer state) are
averaged with the peers under the same key, weighted by samples since the last successful
round. Best-effort: a failed round keeps the local values and training goes on.

With overlap=True the round averages a snapshot in a background thread while local steps go
on; p += averaged - snapshot is applied on the training thread, inside step(), only once the
round has returned completely: a buffer the daemon is still writing is never read.

With `outer_optimizer` it runs DiLoCo instead (client/diloco.py): every `average_every` = H
steps the pseudo-gradients are averaged and the outer optimizer steps a global copy on the CPU.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from moshpit.client import Client, RoundInfo
from moshpit.diloco import OuterConfig, OuterLoop, RoundFuture
from moshpit.errors import DaemonUnavailable, MoshpitError
from moshpit.link import DaemonLink, in_background
from moshpit.round_args import RoundArgs
from moshpit.trainer_state import (
    AveragingClient,
    PendingRound,
    apply_delta,
    download,
    named_tensors,
    publish,
    stays_non_negative,
    wire_dtype,
)
from moshpit.wrapped import WrappedOptimizer

log = logging.getLogger(__name__)


class Optimizer(WrappedOptimizer):
    """Wraps a torch optimizer; step() takes a local step and averages every few steps.

    What is averaged is named in moshpit.trainer_state (step counters stay local). The list is
    fixed at the first round after the first step (lazily created state exists by then), so
    every peer submits the same shapes in the same order; bf16 travels as float32. Give LR
    schedulers `opt.optimizer`.

    `client` is a moshpit.Client or a socket path; after a DaemonUnavailable the next round
    opens a new connection to the same socket (a fresh Client replaces `opt.client`).
    `grid`, `group_size`, `min_group_size`, `timeout`, `codec`, `initial_coords`,
    `aggregation`, `local_world` and `local_rank` go to Client.average as they are
    (client/round_args.py).

    DiLoCo: `outer_optimizer` (any torch optimizer over the same parameters), `fragments`,
    `delay`, `mix`, `error_feedback` (default: on for int8 and int4); see client/diloco.py.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, client: AveragingClient | str,
                 key: str, average_every: int = 5, *, grid: tuple[int, int] | None = None,
                 group_size: int = 16, min_group_size: int = 2, average_state: bool = False,
                 model: nn.Module | None = None, overlap: bool = False, timeout: float = 30.0,
                 codec: str = "none", initial_coords: Sequence[int] | None = None,
                 share_memory: bool = True, publish_every: int = 1,
                 aggregation: str = "mean",
                 outer_optimizer: torch.optim.Optimizer | None = None, fragments: int = 1,
                 delay: int = 0, mix: float = 0.0, error_feedback: bool | None = None,
                 local_world: int | None = None, local_rank: int | None = None) -> None:
        if average_every < 1:
            raise ValueError(f"average_every must be >= 1, not {average_every}")
        self.diloco: OuterLoop | None = None
        if outer_optimizer is not None:
            if overlap or average_state:
                raise ValueError("overlap and average_state are Moshpit SGD's: with an outer "
                                 "optimizer, use delay= to overlap rounds with inner steps")
            self.diloco = OuterLoop(optimizer, outer_optimizer,
                                    OuterConfig(average_every, fragments, delay, mix, codec,
                                                error_feedback), key, grid,
                                    submit=self._submit, failed=self._failed,
                                    succeeded=self._succeeded)
        elif (fragments, delay, mix, error_feedback) != (1, 0, 0.0, None):
            raise ValueError("fragments, delay, mix and error_feedback need outer_optimizer")
        self.args = RoundArgs(key, grid, group_size, min_group_size, timeout, codec,
                              None if initial_coords is None else tuple(initial_coords),
                              aggregation, local_world, local_rank)
        self.optimizer = optimizer
        self.key, self.average_every = key, average_every
        self.average_state, self.model, self.overlap = average_state, model, overlap
        self.share_memory = share_memory
        self.publish_every = publish_every  # rounds between state snapshots for joiners (0: off)
        self.link = DaemonLink(client, key)  # a socket path: connected now if it can be

        self.local_step = 0
        self.rounds_done = 0
        self.failed_rounds = 0
        self.last_round: RoundInfo | None = None
        self.last_error: MoshpitError | None = None
        self._samples = 0  # since the last successful round: this peer's weight
        self._since_round = 0  # local steps since the last round was started

        self._names: list[str] | None = None  # the averaged list, frozen after the first step
        self._wire: dict[str, list[torch.Tensor]] = {}  # buffers handed to the client, by key
        self._pending: PendingRound | None = None
        self._warned_new: set[str] = set()

    @property
    def client(self) -> AveragingClient | None:
        return self.link.client

    # --- the training loop ------------------------------------------------------------------
    def step(self, closure: Callable[[], float] | None = None, batch_size: int = 1) -> Any:
        """One local step on `batch_size` samples; averages when it is time to."""
        if self.diloco is not None:
            self.diloco.before_step()
        loss = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        self.local_step += 1
        self._samples += int(batch_size)
        self._since_round += 1
        if self.diloco is not None:
            self.diloco.after_step(self.local_step, int(batch_size))
        elif self.overlap:
            self._poll()
            if self._pending is None and self._since_round >= self.average_every:
                self._launch()
        elif self._since_round >= self.average_every:
            self._average_blocking()
        return loss

    def sync(self, min_group_size: int | None = None, timeout: float | None = None) -> bool:
        """Average now, blocking: a collective point every peer calls (e.g. with
        min_group_size=world before and after training). True on success.

        It averages under its own key (`key + "/sync"`) without the grid, so it never pairs with
        a peer's regular round, whose tensor list may differ (no optimizer state before the
        first step) and whose timing does not line up. In overlap mode the round in flight is
        finished and applied first. With an outer optimizer: an outer step of every fragment
        at once (pseudo-gradients since each one's last sync)."""
        self.finish()
        args = self.args.sync_overrides(min_group_size, timeout)
        if self.diloco is not None:
            return self.diloco.sync_all({**args, "rounds": 1})
        return self._average_blocking(args)

    def finish(self) -> None:
        """Wait for the rounds in flight (overlap mode, DiLoCo's delay) and apply them."""
        if self.diloco is not None:
            self.diloco.finish()
        if self._pending is not None:
            with contextlib.suppress(Exception):
                self._pending.future.exception()  # waits; errors are handled by _poll
            self._poll()

    def close(self) -> None:
        """Finish the round in flight; close the client if this optimizer opened it."""
        self.finish()
        self.link.close()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Changes what is averaged: every peer must add the same group at the same step."""
        self.optimizer.add_param_group(param_group)
        self._drop_pending()
        self._reset_layout()

    def state_dict(self) -> dict[str, Any]:
        out = {"optimizer": self.optimizer.state_dict(), "moshpit": {
            "local_step": self.local_step, "rounds_done": self.rounds_done,
            "failed_rounds": self.failed_rounds, "samples": self._samples,
            "since_round": self._since_round}}
        if self.diloco is not None:
            out["outer"] = self.diloco.state_dict()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Takes what state_dict() returned, or a plain state dict of the wrapped optimizer."""
        self._drop_pending()  # its snapshot belongs to the state being replaced
        if "moshpit" in state_dict and "optimizer" in state_dict:
            self.optimizer.load_state_dict(state_dict["optimizer"])
            counters = state_dict["moshpit"]
            self.local_step = int(counters["local_step"])
            self.rounds_done = int(counters["rounds_done"])
            self.failed_rounds = int(counters["failed_rounds"])
            self._samples = int(counters["samples"])
            self._since_round = int(counters["since_round"])
            if self.diloco is not None and "outer" in state_dict:
                self.diloco.load_state_dict(state_dict["outer"])
        else:
            self.optimizer.load_state_dict(state_dict)
        self._reset_layout()

    def __repr__(self) -> str:
        return (f"moshpit.Optimizer({self.optimizer.__class__.__name__}, key={self.key!r}, "
                f"average_every={self.average_every}, overlap={self.overlap}, "
                f"rounds_done={self.rounds_done}, failed_rounds={self.failed_rounds})")

    # --- what is averaged -------------------------------------------------------------------
    def _tensors(self) -> tuple[list[str], list[torch.Tensor]]:
        """The averaged tensors of this round; the list is frozen once a step has been taken."""
        found = dict(named_tensors(self.optimizer, self.model,
                                   "averaged" if self.average_state else "none"))
        if self._names is None:
            names = list(found)
            if self.local_step == 0:  # optimizer state does not exist yet: do not freeze
                return names, [found[n] for n in names]
            self._names = names
        missing = [n for n in self._names if n not in found]
        if missing:
            raise RuntimeError(f"tensors averaged before are gone: {missing[:5]}; call "
                               "load_state_dict/add_param_group on every peer alike")
        for n in found.keys() - set(self._names) - self._warned_new:
            self._warned_new.add(n)
            log.warning("%s appeared after the averaged list was fixed: it stays local", n)
        return self._names, [found[n] for n in self._names]

    def _wire_buffers(self, tensors: list[torch.Tensor], key: str = "") -> list[torch.Tensor]:
        """Tensors handed to the client, shared with the daemon when it can, reused: on the
        CPU, or on the device for CUDA tensors (their values cross the shared buffer by DMA)."""
        wire = self._wire.get(key)
        # one device for all (Adam's step counts stay on the CPU beside CUDA parameters)
        device = next((t.device for t in tensors if t.device.type == "cuda"),
                      torch.device("cpu"))
        if wire is None or len(wire) != len(tensors) or any(
                w.shape != t.shape or w.dtype != wire_dtype(t) or w.device != device
                for w, t in zip(wire, tensors, strict=True)):
            blank = [torch.empty(t.shape, dtype=wire_dtype(t), device=device)
                     for t in tensors]
            wire = blank
            if self.share_memory and self.client is not None:
                try:
                    wire = list(self.client.share(blank))
                except (AttributeError, NotImplementedError):
                    wire = blank
            self._wire[key] = wire
        return wire

    def _drop_pending(self) -> None:
        if self._pending is not None:
            with contextlib.suppress(Exception):
                self._pending.future.exception()  # the client's buffers are ours again
            self._pending = None

    def _reset_layout(self) -> None:
        self._names = None
        self._wire = {}

    # --- rounds -----------------------------------------------------------------------------
    def _connect(self) -> bool:
        """Opens a fresh connection after the daemon went away (or was never reached)."""
        try:
            if self.link.connect():
                self._wire = {}  # shared memory belongs to the old connection
        except MoshpitError as exc:
            self._failed(exc, "cannot reach the daemon")
            return False
        return self.client is not None

    def _average_blocking(self, overrides: dict[str, Any] | None = None) -> bool:
        self._since_round = 0
        if not self._connect():
            return False
        _, tensors = self._tensors()
        wire = self._wire_buffers(tensors)
        with torch.no_grad():
            for w, t in zip(wire, tensors, strict=True):
                w.copy_(t)
        sent = self._samples
        try:
            out, info = self._call(wire, float(max(sent, 1)), overrides)
        except MoshpitError as exc:
            self._failed(exc, f"round at step {self.local_step} failed, keeping local values")
            return False
        with torch.no_grad():
            for t, a in zip(tensors, out, strict=True):
                t.copy_(a)
        self._succeeded(sent, info)
        return True

    def _call(self, wire: list[torch.Tensor], weight: float,
              overrides: dict[str, Any] | None = None) -> tuple[list[torch.Tensor],
                                                                RoundInfo | None]:
        """One round through the client. Moshpit SGD weighs a peer that saw no sample as 1
        (all-zero weights would make the group's mean undefined)."""
        client = self.client
        assert client is not None
        out = client.average(wire, weight=weight,
                             **{**self.args.average_kwargs(), **(overrides or {})})
        if len(out) != len(wire):
            raise MoshpitError(f"the client returned {len(out)} tensors for {len(wire)}")
        return list(out), getattr(client, "last_round", None)

    def _launch(self) -> None:
        """Starts a background round on a snapshot of the tensors (overlap mode)."""
        self._since_round = 0
        if not self._connect():
            return
        names, tensors = self._tensors()
        wire = self._wire_buffers(tensors)
        with torch.no_grad():
            snapshot = [t.detach().clone() for t in tensors]
            for w, s in zip(wire, snapshot, strict=True):
                w.copy_(s)
        samples, weight = self._samples, float(max(self._samples, 1))
        future = in_background(lambda: self._call(wire, weight), f"moshpit-average-{self.key}")
        self._pending = PendingRound(future, names, snapshot, samples)

    def _submit(self, key: str, tensors: list[torch.Tensor], weight: float,
                overrides: dict[str, Any]) -> RoundFuture | None:
        """A DiLoCo round in the background on copies of `tensors` (None: no daemon)."""
        if not self._connect():
            return None
        wire = self._wire_buffers(tensors, key)
        with torch.no_grad():
            for w, t in zip(wire, tensors, strict=True):
                w.copy_(t)
        return in_background(lambda: self._call(wire, weight, {**overrides, "key": key}),
                             f"moshpit-average-{key}")

    def _poll(self) -> None:
        """Applies the background round if it has returned; on the training thread only."""
        pending = self._pending
        if pending is None or not pending.future.done():
            return
        self._pending = None
        exc = pending.future.exception()
        if isinstance(exc, MoshpitError):
            self._failed(exc, f"background round failed (seen at step {self.local_step}), "
                              "keeping local values")
            return
        if exc is not None:
            raise exc
        out, info = pending.future.result()
        _, tensors = self._tensors()  # the list was frozen before launch: the same names
        self._apply_delta(tensors, pending.snapshot, out, pending.names)
        self._succeeded(pending.samples, info)

    def _apply_delta(self, tensors: list[torch.Tensor], snapshot: list[torch.Tensor],
                     averaged: list[torch.Tensor], names: list[str]) -> None:
        """t += averaged - snapshot: the group's correction, keeping local progress since."""
        apply_delta(tensors, snapshot, averaged, names)

    def _succeeded(self, samples: int, info: RoundInfo | None) -> None:
        self._samples -= samples
        self.rounds_done += 1
        self.last_round = info
        self.last_error = None
        if self.publish_every and self.rounds_done % self.publish_every == 0:
            self.publish_state()

    # --- live state for joiners -----------------------------------------------------------
    @property
    def state_key(self) -> str:
        return self.args.state_key

    def publish_state(self) -> bool:
        """Hand this peer's state to its daemon, which serves it to peers that join later
        (without blocking this trainer). Peers at the same local step publish the same
        version, so a joiner downloads from several of them at once."""
        if self.client is None or not hasattr(self.client, "publish_state"):
            return False
        try:
            if self.diloco is not None:  # the global copy and the outer state
                self.diloco.publish(self.client, self.state_key, self.local_step,
                                    self.args.timeout)
            else:
                publish(self.client, self.state_key, self.optimizer, self.model,
                        self.local_step, self.args.timeout)
        except MoshpitError as exc:
            log.warning("moshpit %s: publishing state failed: %s", self.key, exc)
            return False
        return True

    def load_state_from_peers(self, timeout: float = 30.0) -> int:
        """Start from the swarm's current state: parameters, buffers, optimizer state and step
        counter, downloaded from peers' daemons. Call it before the first step of a trainer
        that joins a running job; returns the local step it resumes at. Raises
        moshpit.StateUnavailable if no peer answers within `timeout`."""
        if not self._connect() or not isinstance(self.client, Client):
            raise DaemonUnavailable("no daemon to download the state through")
        if self.diloco is not None:
            self.local_step = self.diloco.download(self.client, self.state_key, timeout)
        else:
            self.local_step = download(self.client, self.state_key, self.optimizer,
                                       self.model, timeout)
        self._since_round = self._samples = 0
        return self.local_step

    def _failed(self, exc: MoshpitError, what: str) -> None:
        self.failed_rounds += 1
        self.last_error = exc
        if isinstance(exc, DaemonUnavailable):
            self.link.broken = True  # the next round retries, on a new connection if we can
            self._wire = {}
        log.warning("moshpit %s: %s: %s", self.key, what, exc)


__all__ = ["AveragingClient", "Optimizer", "stays_non_negative"]
