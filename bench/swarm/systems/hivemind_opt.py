"""hivemind 1.1.12's hivemind.Optimizer, the system users would pick instead of moshpit.

Runs in .venv-peers (make peers) and imports nothing from moshpit or moshpitd. hivemind forks
its helper processes (DHT, averagers, p2pd), so the start method is set to fork before it is
imported. Two systems share this module:

- `hivemind-sync`: the default mode, synchronous large-batch training. Peers accumulate
  gradients until the swarm has processed `target_batch_size` samples, average them, and all
  take one AdamW step.
- `hivemind-local`: `use_local_updates=True`, its local-SGD mode. Every peer steps AdamW on
  its own gradients and the parameters are averaged once per `target_batch_size` samples:
  the natural rival of the DiLoCo rows, run at their period (64 local steps per host).

Both are set up as hivemind's guide, quickstart and ALBERT example advise for a run of this
size: every setting, its value and the line it follows are in
bench/swarm/systems/hivemind_settings.py (docs/results.md shows the same table). Knobs
(spec.knobs) override them by name: `epoch_steps` (local steps per host per epoch, so
target_batch_size = hosts x batch x epoch_steps), `lr_rule` (sqrt or none),
`average_state_every`, `delayed_updates`, `matchmaking_time`, `averaging_timeout`,
`request_timeout`, `target_group_size`, `fp16`; the orchestrator passes `bandwidth`, the
host's link rate in Mbit/s from the scenario.

- The DHT listens on tcp/port_base at this host's IP. Host 0 writes its visible multiaddrs
  to shared_dir/hivemind-dht-0.json; every other host bootstraps from the hosts' files it finds
  (waiting for host 0's), then writes its own, so a returning host finds live peers.
- A host that comes back (rejoin) calls `load_state_from_peers` before training, as hivemind's
  quickstart says a joining peer should.
- At the end of the budget the host saves the model it holds (`budget`), as every system does;
  nothing after it is scored. hivemind has no final sync of its own to run.

`sync` events come from hivemind's own log lines ("Averaged gradients with N peers",
"Averaged parameters with N peers", and their failures); `seconds` there is the time the
training loop spent inside opt.step() since the previous sync event.
"""

from __future__ import annotations

import functools
import json
import logging
import multiprocessing
import os
import queue
import re
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

multiprocessing.set_start_method("fork", force=True)

import hivemind  # noqa: E402  (after the start method is set)
from hivemind.compression import Float16Compression  # noqa: E402
from hivemind.optim.grad_averager import GradientAverager  # noqa: E402

from bench.swarm.systems.hivemind_settings import settings  # noqa: E402
from bench.swarm.worker import Events, LocalTrainer, WorkerSpec  # noqa: E402
from bench.swarm.workload import adamw, param_groups  # noqa: E402

RUN_ID = "swarm"
BOOTSTRAP_WAIT_S = 120.0
_SYNC_LINES = (  # (pattern, what was averaged, ok)
    (re.compile(r"Averaged gradients with (\d+) peers"), "gradients", True),
    (re.compile(r"Averaged parameters with (\d+) peers"), "parameters", True),
    (re.compile(r"Averaging gradients failed with (.*)"), "gradients", False),
    (re.compile(r"Averaging failed with (.*)"), "parameters", False),
)


class SyncLog(logging.Handler):
    """Turns hivemind's round log lines (from any of its threads) into queued sync records."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        for pattern, what, ok in _SYNC_LINES:
            found = pattern.search(msg)
            if found:
                fields: dict[str, Any] = {"ok": ok, "what": what, "t_round": record.created}
                if ok:
                    fields["group_size"] = int(found.group(1))
                else:
                    fields["group_size"], fields["error"] = 1, found.group(1)[:200]
                self.records.put(fields)
                return


def _peer_file(spec: WorkerSpec, host: int) -> Path:
    return spec.shared_dir / f"hivemind-dht-{host}.json"


def initial_peers(spec: WorkerSpec) -> list[str]:
    """Multiaddrs of the other hosts that wrote theirs; host 0's is waited for (it starts the
    swarm), unless this is host 0 itself."""
    deadline = time.monotonic() + BOOTSTRAP_WAIT_S
    while True:
        peers = []
        for host in range(spec.hosts):
            path = _peer_file(spec, host)
            if host != spec.host and path.exists():
                peers += json.loads(path.read_text())
        if peers or (spec.host == 0 and not spec.rejoin):
            return peers
        if time.monotonic() > deadline:
            raise TimeoutError(f"no hivemind peer file in {spec.shared_dir} after "
                               f"{BOOTSTRAP_WAIT_S:.0f} s")
        time.sleep(0.2)


def start_dht(spec: WorkerSpec) -> hivemind.DHT:
    dht = hivemind.DHT(host_maddrs=[f"/ip4/{spec.ip}/tcp/{spec.port_base}"],
                       initial_peers=initial_peers(spec), start=True)
    spec.shared_dir.mkdir(parents=True, exist_ok=True)
    path = _peer_file(spec, spec.host)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([str(a) for a in dht.get_visible_maddrs()]))
    os.replace(tmp, path)
    return dht


def optimizer_for(spec: WorkerSpec, trainer: LocalTrainer, dht: hivemind.DHT
                  ) -> hivemind.Optimizer:
    """hivemind.Optimizer as hivemind_settings.settings() says for this row and host."""
    hyper = spec.hyper
    chosen = settings(spec.system, spec.hosts, spec.batch, hyper.lr, spec.knobs)
    extra: dict[str, Any] = {}
    if chosen.fp16:
        extra["grad_compression"] = Float16Compression()
        extra["state_averaging_compression"] = Float16Compression()
    if not chosen.use_local_updates:
        # what the docstring promises for averager_opts, which 1.1.12 gives the state
        # averager only (hivemind_settings.SETTINGS, grad_averager_factory)
        extra["grad_averager_factory"] = functools.partial(GradientAverager,
                                                           **chosen.averager_opts)
    return hivemind.Optimizer(
        dht=dht, run_id=RUN_ID, batch_size_per_step=spec.batch,
        params=param_groups(trainer.model, hyper),
        optimizer=lambda groups: adamw(groups, replace(hyper, lr=chosen.lr)),
        verbose=True, **chosen.optimizer_kwargs(), **extra)


def run(spec: WorkerSpec, events: Events) -> None:
    sync_log = SyncLog()
    logging.getLogger("hivemind").addHandler(sync_log)
    trainer = LocalTrainer(spec, events)
    dht = start_dht(spec)
    opt = optimizer_for(spec, trainer, dht)
    trainer.optimizer = opt  # zero_grad through hivemind's optimizer
    if spec.rejoin:
        opt.load_state_from_peers()
        events.emit("rejoined", epoch=opt.local_epoch)
    trainer.wait_for_start()
    in_step = 0.0
    while trainer.time_left() > 0:
        trainer.compute_loss()
        t0 = time.perf_counter()
        opt.step()
        in_step += time.perf_counter() - t0
        trainer.advance()
        while not sync_log.records.empty():
            events.emit("sync", seconds=in_step, epoch=opt.local_epoch,
                        **sync_log.records.get())
            in_step = 0.0
    trainer.end_of_budget()
    trainer.snapshot("done")
    shutdown(opt, dht)


def shutdown(opt: hivemind.Optimizer, dht: hivemind.DHT, timeout: float = 15.0) -> None:
    """hivemind's shutdown can wait on peers that left; the results are saved already."""
    def stop() -> None:
        opt.shutdown()
        dht.shutdown()

    worker = threading.Thread(target=stop, daemon=True)
    worker.start()
    worker.join(timeout)
