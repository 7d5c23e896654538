"""hivemind 1.1.12's hivemind.Optimizer, the system users would pick instead of moshpit.

Runs in .venv-peers (make peers) and imports nothing from moshpit or moshpitd. hivemind forks
its helper processes (DHT, averagers, p2pd), so the start method is set to fork before it is
imported. Two systems share this module:

- `hivemind-sync`: the default mode, synchronous large-batch training. Peers accumulate
  gradients until the swarm has processed `target_batch_size` samples, average them, and all
  take one AdamW step.
- `hivemind-local`: `use_local_updates=True`, its local-SGD mode. Every peer steps AdamW on
  its own gradients and the parameters are averaged once per `target_batch_size` samples.

Knobs (spec.knobs overrides each):
- `target_batch_size` = H x batch x τ for both modes, with `tau` (τ) the knob Moshpit SGD
  uses as `average_every` (default 5, moshpit.Optimizer's default): one rule for every system
  but DDP, which communicates every step by construction. So every peer communicates after
  about τ local steps.
- `matchmaking_time` = 3 s and `averaging_timeout` = 10 s, as hivemind's guide advises for a
  run this size: its Optimizer docstring says "matchmaking_time=15.0, # 3-5s for small local
  runs, 10-15s for training over the internet or with many peers", and its quickstart passes
  `matchmaking_time=3.0, averaging_timeout=10.0`.
- `averager_opts={"target_group_size": hosts}`, as its ALBERT example passes averager_opts with
  a target group size: without one, a leader forms its group only when its declared
  expiration runs out, so every round would take the whole matchmaking time even with every
  peer there.
- `average_state_every` = 1, `delay_state_averaging` = True, no compression, no offloading:
  hivemind.Optimizer's constructor defaults.

What these settings mean here (hivemind 1.1.12's own behaviour, not the loop's): its
TrainingStateAverager runs the averaging round and the local optimizer steps on one
single-thread executor, so with delay_optimizer_step=False (its default without
offload_optimizer) opt.step() waits while a round runs. At τ = 5 an epoch is a few seconds
of compute; hivemind's docs recommend "very large batch sizes to reduce the % of time spent on
communication".
- The DHT listens on tcp/port_base at this host's IP. Host 0 writes its visible multiaddrs
  to shared_dir/hivemind-dht-0.json; every other host bootstraps from the hosts' files it finds
  (waiting for host 0's), then writes its own, so a returning host finds live peers.
- A host that comes back (rejoin) calls `load_state_from_peers` before training, as hivemind's
  docs say a joining peer should.

`sync` events come from hivemind's own log lines ("Averaged gradients with N peers",
"Averaged parameters with N peers", and their failures); `seconds` there is the time the
training loop spent inside opt.step() since the previous sync event.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import queue
import re
import threading
import time
from pathlib import Path
from typing import Any

multiprocessing.set_start_method("fork", force=True)

import hivemind  # noqa: E402  (after the start method is set)

from bench.swarm.worker import Events, LocalTrainer, WorkerSpec  # noqa: E402
from bench.swarm.workload import adamw, param_groups  # noqa: E402

RUN_ID = "swarm"
TAU = 5  # moshpit.Optimizer's default average_every: the shared `tau` knob's default
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


def run(spec: WorkerSpec, events: Events) -> None:
    local = spec.system == "hivemind-local"
    sync_log = SyncLog()
    logging.getLogger("hivemind").addHandler(sync_log)
    trainer = LocalTrainer(spec, events)
    dht = start_dht(spec)
    hyper = spec.hyper
    opt = hivemind.Optimizer(
        dht=dht, run_id=RUN_ID, batch_size_per_step=spec.batch,
        target_batch_size=int(spec.knob("target_batch_size",
                                        spec.hosts * spec.batch * int(spec.knob("tau", TAU)))),
        params=param_groups(trainer.model, hyper),
        optimizer=lambda groups: adamw(groups, hyper),
        use_local_updates=local,
        matchmaking_time=float(spec.knob("matchmaking_time", 3.0)),
        averaging_timeout=float(spec.knob("averaging_timeout", 10.0)),
        averager_opts={"target_group_size": int(spec.knob("target_group_size", spec.hosts))},
        verbose=True)
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
