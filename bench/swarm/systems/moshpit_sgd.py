"""Moshpit SGD: moshpit.Optimizer around AdamW, parameters averaged every τ steps on a grid.

The orchestrator starts this host's moshpitd (spec.ipc_socket) before the worker. Three rows
run it: `moshpit` (one trainer per host), and with several trainers per host (bench/swarm/
layout.py) `moshpit-local` (the host's trainers pass local_world and are one peer) and
`moshpit-each` (each trainer has its own daemon and is its own peer). The orchestrator's
knobs `peers`, `peer` and `local_world` say which (defaults: H, the host, None).

Knobs (spec.knobs overrides each; the values below are what the benchmark uses):
- `tau` (τ) = 5, moshpit.Optimizer's default `average_every`.
- `grid` = (M, 2) with M = ceil(sqrt(P)) for P peers: the paper's square grid, rule not tuned;
  peer i keeps cell (i mod M, i div M), so a host that comes back takes its old cell.
- `timeout` = 30 s, `group_size` = 16, `min_group_size` = 2, `overlap` = False,
  `average_state` = False, `codec` = "none": moshpit.Optimizer's defaults.
- At the deadline each trainer saves the model it holds (`budget`): the one the table scores,
  as for every system. Then it calls `opt.sync(min_group_size=final_group)` (knob
  `final_group`, default H: the peers alive at the end), falling back to pairs if it cannot
  gather them, so the hosts' final models agree; that sync is checked, not scored.
- A host that comes back (rejoin) first downloads the state from its peers
  (`load_state_from_peers`), as docs/trainer.md says a joiner should; if none answers within the
  timeout it trains on from the initial model (its `rejoined` event carries the error).
"""

from __future__ import annotations

import math
import time
from typing import Any

import moshpit
from bench.swarm.worker import Events, LocalTrainer, WorkerSpec

KEY = "swarm"
TAU = 5  # moshpit.Optimizer's default average_every
CONNECT_TIMEOUT_S = 60.0


def grid_for(hosts: int) -> tuple[int, int]:
    return (max(2, math.ceil(math.sqrt(hosts))), 2)


def connect(socket_path: str, timeout: float = CONNECT_TIMEOUT_S) -> moshpit.Client:
    """The host's daemon may still be starting: retry until it answers."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return moshpit.Client(socket_path)
        except moshpit.DaemonUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def round_fields(opt: moshpit.Optimizer) -> dict[str, Any]:
    info = opt.last_round
    if info is None:
        return {}
    fields = {"group_size": info.group_size, "group_sizes": list(info.group_sizes),
              "round_seconds": info.seconds,
              "matchmaking_seconds": info.matchmaking_seconds, "bytes_sent": info.bytes_sent,
              # False: a part's owner failed and its elements kept this peer's values
              "fully_averaged": info.fully_averaged}
    if info.local_ranks:  # moshpit-local: the host's trainers whose values it sent
        fields["local_ranks"] = list(info.local_ranks)
    return fields


def run(spec: WorkerSpec, events: Events) -> None:
    assert spec.ipc_socket is not None  # WorkerSpec.validate
    peers, peer = int(spec.knob("peers", spec.hosts)), int(spec.knob("peer", spec.host))
    grid = tuple(spec.knob("grid", grid_for(peers)))
    cell = (peer % grid[0], (peer // grid[0]) % grid[0])
    local_world = spec.knob("local_world", None)
    trainer = LocalTrainer(spec, events)
    client = connect(spec.ipc_socket)
    opt = moshpit.Optimizer(
        trainer.optimizer, client=client, key=KEY,
        average_every=int(spec.knob("tau", TAU)), grid=(grid[0], grid[1]),
        initial_coords=cell, group_size=int(spec.knob("group_size", 16)),
        min_group_size=int(spec.knob("min_group_size", 2)),
        timeout=float(spec.knob("timeout", 30.0)), overlap=bool(spec.knob("overlap", False)),
        average_state=bool(spec.knob("average_state", False)),
        codec=str(spec.knob("codec", "none")), model=trainer.model,
        local_world=None if local_world is None else int(local_world))
    if spec.rejoin:
        try:
            trainer.step = opt.load_state_from_peers(timeout=float(spec.knob("timeout", 30.0)))
            events.emit("rejoined", step=trainer.step)
        except moshpit.MoshpitError as exc:  # train on from the initial model, averaged in later
            events.emit("rejoined", step=0, error=f"{type(exc).__name__}: {exc}"[:200])
    trainer.wait_for_start()
    while trainer.time_left() > 0:
        train_step(spec, trainer, opt, events)
    trainer.end_of_budget()  # what the table scores; the final sync below is not
    final_sync(spec, opt, events)
    trainer.snapshot("done")
    opt.close()
    client.close()


def train_step(spec: WorkerSpec, trainer: LocalTrainer, opt: moshpit.Optimizer,
               events: Events) -> None:
    """One optimizer step; a round it finished or failed is reported as a sync event."""
    trainer.compute_loss()
    done, failed = opt.rounds_done, opt.failed_rounds
    t0 = time.perf_counter()
    opt.step(batch_size=spec.batch)
    seconds = time.perf_counter() - t0
    trainer.advance()
    if opt.rounds_done > done:
        events.emit("sync", ok=True, seconds=seconds, **round_fields(opt))
    elif opt.failed_rounds > failed:
        events.emit("sync", ok=False, group_size=1, seconds=seconds,
                    error=str(opt.last_error)[:200])


def final_sync(spec: WorkerSpec, opt: moshpit.Optimizer, events: Events) -> None:
    """Average with every live host so their final models agree; pairs if they cannot meet."""
    want = int(spec.knob("final_group", spec.hosts))
    for group in dict.fromkeys((want, 2)):
        t0 = time.perf_counter()
        ok = opt.sync(min_group_size=group)
        events.emit("sync", ok=ok, final=True, seconds=time.perf_counter() - t0,
                    **(round_fields(opt) if ok else {"group_size": 1}))
        if ok:
            return
