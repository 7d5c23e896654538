"""Moshpit DiLoCo: moshpit.Optimizer with an outer optimizer (docs/diloco.md), three rows.

The orchestrator starts this host's moshpitd (spec.ipc_socket) before the worker, as for
Moshpit SGD. Every row: the inner optimizer is the AdamW every system uses (same per-host
batch, same budget); the outer one is SGD(lr 0.7, momentum 0.9, nesterov), the paper's.

Knobs per row (spec.knobs overrides each):

| system | H (`every`) | `codec` | `fragments` | `delay` |
|---|---|---|---|---|
| diloco-fp16 | 64 | fp16 | 1 | 0 |
| diloco-int4 | 64 | int4, error feedback on (its default) | 1 | 0 |
| diloco-stream | 64 | fp16 | 4 | 5 |

- `grid` = (hosts, 1): one grid line holding every host, so a sync is one round of the whole
  swarm, and a grid run waits for the line-mates it knows (up to the round's deadline) where
  a plain key assembles without a peer that comes more than half a second after the rest.
  A group of n sends 2 (n - 1)/n of the vector per member and sync (its share out, its own
  share's mean back): per local step a host sends 1.5 x 2 bytes x P / 64 with fp16 at n = 4
  against DDP's 1.5 x 4 bytes x P, 128x less (int4: 455x).
- H = 64 also keeps the calls under one key less than a minute apart on this machine (0.3 to
  0.7 s a step): a grid run forgets a daemon whose entry was not renewed for 60 s (moshpitd's
  ENTRY_TTL); in a trial with H = 100 the hosts no longer expected each other at the first
  sync, and averaged in pairs or kept their own pseudo-gradients.
- `timeout` = 30 s, `min_group_size` = 2: moshpit.Optimizer's defaults.
- `publish_steps` = 10: besides after every outer step (moshpit's default), each host
  publishes its state every 10 steps, so a host that comes back resumes at most about 10
  steps behind the swarm's step count (the outer steps' schedule) instead of up to H.
- Before the clock starts, the hosts wait for each other (one round of every host under a
  plain key), then make one round of a single float under each fragment's grid key
  (`join_runs`): a grid run waits only for the line-mates it knows, and a daemon is known
  from its first call, which DiLoCo makes H steps in. Without it, hosts whose step counts
  drifted apart by a few seconds found nobody expecting them at the first sync; without the
  wait, hosts that finished starting 20 s apart began the runs a round apart and averaged in
  two pairs for the whole run.
- A host that comes back downloads the global copy and the outer optimizer's state
  (`load_state_from_peers`) before its first step, as docs/diloco.md says a joiner should.
- No state is published while a round is in flight: the client serves one call at a time,
  so the publish, and training with it, would wait for the round.
- At the deadline each host saves the model it holds (`budget`), the one the table scores as
  for every system; what follows is checked, not scored.
- After the budget: `opt.sync(min_group_size=final_group)` (an outer step of every host's
  pseudo-gradient since its last sync; pairs if the hosts cannot all meet), then one plain
  average of the parameters in the same group. DiLoCo's global copies drift apart when a
  round was partial (a host gone, a part that timed out), and the outer step does not pull
  them together; the average makes the hosts end on one model, as Moshpit SGD's final sync
  does.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

import moshpit
from bench.swarm.systems.moshpit_sgd import connect, final_sync, train_step
from bench.swarm.worker import Events, LocalTrainer, WorkerSpec

KEY = "swarm-diloco"
ROWS: dict[str, dict[str, Any]] = {
    "diloco-fp16": {"every": 64, "codec": "fp16", "fragments": 1, "delay": 0},
    "diloco-int4": {"every": 64, "codec": "int4", "fragments": 1, "delay": 0},
    "diloco-stream": {"every": 64, "codec": "fp16", "fragments": 4, "delay": 5},
}
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9
PUBLISH_STEPS = 10
JOIN_TIMEOUT_S = 120.0  # the hosts finish starting within this (startup is not timed)


def knobs(spec: WorkerSpec) -> dict[str, Any]:
    return {**ROWS[spec.system], **spec.knobs}


def run(spec: WorkerSpec, events: Events) -> None:
    assert spec.ipc_socket is not None  # WorkerSpec.validate
    row = knobs(spec)
    grid = tuple(row.get("grid", (spec.hosts, 1)))
    cell = tuple((spec.host // grid[0] ** k) % grid[0] for k in range(grid[1]))
    trainer = LocalTrainer(spec, events)
    client = connect(spec.ipc_socket)
    outer = torch.optim.SGD(trainer.model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM,
                            nesterov=True)
    timeout = float(row.get("timeout", 30.0))
    opt = moshpit.Optimizer(
        trainer.optimizer, client=client, key=KEY, average_every=int(row["every"]),
        grid=(int(grid[0]), int(grid[1])), initial_coords=cell,
        group_size=int(row.get("group_size", spec.hosts)),
        min_group_size=int(row.get("min_group_size", 2)), timeout=timeout,
        codec=str(row["codec"]), outer_optimizer=outer, fragments=int(row["fragments"]),
        delay=int(row["delay"]), model=trainer.model)
    loop = opt.diloco
    assert loop is not None  # an outer optimizer was given
    if spec.rejoin:
        t0 = time.perf_counter()
        try:
            trainer.step = opt.load_state_from_peers(timeout=timeout)
            events.emit("rejoined", step=trainer.step, seconds=time.perf_counter() - t0)
        except moshpit.MoshpitError as exc:  # train on from the initial model
            events.emit("rejoined", step=0, seconds=time.perf_counter() - t0,
                        error=f"{type(exc).__name__}: {exc}"[:200])
    elif row.get("join_runs", True):  # a host that comes back is known: it keeps its key
        join_runs(client, [loop.key_of(p) for p in range(loop.config.fragments)],
                  (int(grid[0]), int(grid[1])), cell, spec.hosts)
    publish_steps = int(row.get("publish_steps", PUBLISH_STEPS))
    trainer.wait_for_start()
    while trainer.time_left() > 0:
        train_step(spec, trainer, opt, events)
        # not while a round is in flight: the client serves one call at a time, and the
        # publish would wait for the round (with `delay`, training would)
        if publish_steps and opt.local_step % publish_steps == 0 and not loop.pending:
            opt.publish_state()
    trainer.end_of_budget()  # what the table scores; the final sync below is not
    final_sync(spec, opt, events)
    average_parameters(spec, trainer, client, events, timeout)
    trainer.snapshot("done")
    opt.close()
    client.close()


def join_runs(client: moshpit.Client, keys: list[str], grid: tuple[int, int],
              cell: tuple[int, ...], hosts: int) -> None:
    """One round of a single float under each grid key with every host, before the clock
    starts. A grid run waits for the line-mates it knows, and a daemon is known from its first
    call, which DiLoCo makes H steps in: hosts that drifted apart by a few seconds would find
    nobody expecting them. First a round of every host under a plain key, which waits for the
    last one to finish starting (a grid round gets one matchmaking attempt, a few seconds), so
    that all begin each grid run at the same round number: hosts that finished starting 20 s
    apart otherwise began a round apart, and met only those a round from them all run long."""
    with contextlib.suppress(moshpit.MoshpitError):  # then the runs, as well as we can
        client.average([torch.zeros(1)], key=f"{KEY}/start", group_size=hosts,
                       min_group_size=hosts, timeout=JOIN_TIMEOUT_S)
    for key in keys:
        with contextlib.suppress(moshpit.MoshpitError):  # registered all the same
            client.average([torch.zeros(1)], key=key, grid=grid, rounds=1,
                           initial_coords=cell, group_size=hosts, timeout=JOIN_TIMEOUT_S)


def average_parameters(spec: WorkerSpec, trainer: LocalTrainer, client: moshpit.Client,
                       events: Events, timeout: float) -> None:
    """One plain average of the model with the hosts alive at the end (see the docstring)."""
    params = [p for p in trainer.model.parameters()]
    want = int(spec.knob("final_group", spec.hosts))
    for group in dict.fromkeys((want, 2)):
        t0 = time.perf_counter()
        try:
            out = client.average([p.detach() for p in params], key=f"{KEY}/final",
                                 weight=1.0, group_size=group, min_group_size=group,
                                 timeout=2 * timeout + 5.0)
        except moshpit.MoshpitError as exc:
            events.emit("sync", ok=False, final=True, group_size=1,
                        seconds=time.perf_counter() - t0, error=str(exc)[:200])
            continue
        with torch.no_grad():
            for p, avg in zip(params, out, strict=True):
                p.copy_(avg)
        info = client.last_round  # `complete`: no span kept a member's own values
        events.emit("sync", ok=True, final=True, seconds=time.perf_counter() - t0,
                    group_size=info.group_size if info else group,
                    complete=bool(info and info.fully_averaged))
        return
