"""Runs each system in turn on one emulated network: daemons and workers per host, the
scenario's events on schedule, DDP's elastic restarts, interface counters sampled every second.

Every system of a scenario gets the same topology (built once; link rates reset before each
system), the same RunConfig and the same event times, relative to its own `start_at`. Each
host's processes (its trainers_per_host trainers and its daemons; bench/swarm/layout.py)
live in its cgroup with an equal CPU quota; the orchestrator, the delayers and the evaluation
run outside the quotas. What happened is written to
`<out>/<scenario>/<system>/seed<seed>/run.json`; bench/swarm/metrics.py turns it into numbers.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.swarm.hostproc import REPO, WorkerProcess
from bench.swarm.layout import Layout, daemon_ports
from bench.swarm.sampler import Sampler
from bench.swarm.scenario import Scenario
from bench.swarm.systems import DAEMON_SYSTEMS, DDP_SYSTEMS, HIVEMIND_SYSTEMS, MODULES
from netlab import Host, Topology

SYSTEMS = tuple(MODULES)
PORT_BASE = 7710  # the worker's ports: PORT_BASE..PORT_BASE+9 (the daemon has 7700..7702)
PEERS_PYTHON = REPO / ".venv-peers" / "bin" / "python"
DONE_EXIT_S = 3.0  # a worker still running this long after `done` is stopped


@dataclass(frozen=True)
class RunConfig:
    hosts: int
    budget_s: float
    out: Path
    model: str = "small"
    batch: int = 16
    seq_len: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.1
    seed: int = 0  # the data order (every run starts from the same weights)
    snapshot_every_s: float = 10.0
    checkpoint_every_s: float = 30.0  # DDP: the elastic restart resumes from the last one
    startup_s: float = 240.0  # most seconds from launch until every host is ready (not timed)
    final_grace_s: float = 60.0  # after the budget: final syncs, `done`, exit
    cpu_cores: float = 0.5  # per host
    sample_every_s: float = 1.0
    trainers_per_host: int = 1  # the scenario's; all of a host's share its quota
    held_out_windows: int = 4096  # the end models' evaluation set (workload.held_out_set)
    knobs: dict[str, dict[str, Any]] = field(default_factory=dict)  # system -> overrides

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["out"] = str(self.out)
        return out


def run_dir(out: Path, scenario: str, system: str, seed: int) -> Path:
    """Where one run (a system on a scenario with a seed) writes its files and run.json."""
    return out / scenario / system / f"seed{seed}"


def python_for(system: str) -> str:
    return str(PEERS_PYTHON) if system in HIVEMIND_SYSTEMS else sys.executable


class SystemRun:
    """One system on one scenario: start, apply events, collect, clean up."""

    def __init__(self, topo: Topology, scenario: Scenario, system: str, cfg: RunConfig,
                 say: Callable[[str], None]) -> None:
        self.topo, self.scenario, self.system, self.cfg = topo, scenario, system, cfg
        self.say = say
        self.dir = run_dir(cfg.out, scenario.name, system, cfg.seed)
        self.shared = self.dir / "shared"
        self.start_file = self.dir / "start_at"
        self.layout = Layout(system, cfg.hosts, cfg.trainers_per_host)
        self.workers: list[WorkerProcess] = []
        self.current: dict[int, list[WorkerProcess]] = {}  # host -> its live trainers
        self.gens: dict[int, int] = {}
        self.ddp_generation = 0
        self.ddp_world: list[int] = []
        self.down: set[int] = set()
        self.actions: list[dict[str, Any]] = []
        self.daemons: dict[int, list[str]] = {}  # host -> ipc sockets of its live daemons
        self.daemon_count = 0
        self.start_at = 0.0
        self.end_at = 0.0
        self.tx_at_start = [0] * cfg.hosts

    # --- processes --------------------------------------------------------------------------
    def _spec(self, host: int, trainer: int, start_at: float | None, rejoin: bool
              ) -> dict[str, Any]:
        cfg = self.cfg
        gen = self.gens[host]
        name = f"h{host}-g{gen}" if cfg.trainers_per_host == 1 else f"h{host}-t{trainer}-g{gen}"
        spec: dict[str, Any] = {
            "system": self.system, "host": host, "hosts": cfg.hosts,
            "host_ips": [h.ip for h in self.topo.hosts], "port_base": PORT_BASE,
            "seed": cfg.seed, "model": cfg.model, "batch": cfg.batch, "seq_len": cfg.seq_len,
            "lr": cfg.lr, "weight_decay": cfg.weight_decay,
            "budget_s": cfg.budget_s if start_at is None else self.end_at - start_at,
            "start_at": start_at,
            "start_file": str(self.start_file) if start_at is None else None,
            "out_dir": str(self.dir / name), "shared_dir": str(self.shared),
            "snapshot_every_s": cfg.snapshot_every_s, "rejoin": rejoin, "knobs": {},
            "trainer": trainer, "trainers_per_host": cfg.trainers_per_host}
        if self.system in DAEMON_SYSTEMS:
            spec["ipc_socket"] = self.daemons[host][self.layout.daemon(trainer)]
            # the final sync gathers the hosts alive at the end (the schedule says how many)
            gone = {e.host_index(cfg.hosts) for e in self.scenario.events
                    if e.kind == "preempt" and e.until is None}
            spec["knobs"] = self.layout.knobs(host, trainer, cfg.hosts - len(gone))
        if self.system in HIVEMIND_SYSTEMS:  # what its averager declares (hivemind_settings)
            spec["knobs"]["bandwidth"] = self.topo.hosts[host].link.rate_mbit
        spec["knobs"].update(cfg.knobs.get(self.system, {}))
        if self.system in DDP_SYSTEMS:
            master = self.topo.hosts[self.ddp_world[0]].ip
            spec["ddp"] = {"world": list(self.ddp_world), "generation": self.ddp_generation,
                           "master": f"{master}:{PORT_BASE + self.ddp_generation % 10}",
                           "resume": self._last_checkpoint(),
                           "checkpoint_every_s": cfg.checkpoint_every_s}
        return spec

    def _launch(self, host: int, start_at: float | None, rejoin: bool) -> None:
        """The host's trainers: a new incarnation (generation) of each."""
        self.gens[host] = self.gens.get(host, -1) + 1
        self.current[host] = []
        for trainer in range(self.cfg.trainers_per_host):
            spec = self._spec(host, trainer, start_at, rejoin)
            worker = WorkerProcess.start(self.topo, self.topo.hosts[host],
                                         python_for(self.system), spec, self.gens[host])
            self.workers.append(worker)
            self.current[host].append(worker)

    def _start_daemons(self, host: int) -> None:
        """The host's daemons: the first bootstraps from a live host's first daemon, the
        others from the host's own first one."""
        live = [i for i in range(self.cfg.hosts) if i != host and i in self.daemons]
        self.daemons[host] = []
        for index in range(self.layout.daemons_per_host):
            boot: list[Host] = ([self.topo.hosts[live[0]]] if live else []) if index == 0 \
                else [self.topo.hosts[host]]
            self.daemon_count += 1
            name = f"{self.system}-h{host}-d{self.daemon_count}"
            daemon = self.topo.start_daemon(self.topo.hosts[host], bootstrap=boot, wait=True,
                                            name=name, ports=daemon_ports(index))
            self.daemons[host].append(daemon.socket)

    def _kill(self, host: int, reason: str) -> None:
        """SIGKILL everything of the host (its cgroup): trainers, daemons, helpers."""
        workers = self.current.pop(host, [])
        for worker in workers:
            if worker.alive() and worker.last("done") is None:
                worker.mark_killed(reason)  # one that finished (said `done`) was not killed
        self.topo.kill_host(self.topo.hosts[host])
        for worker in workers:
            worker.finish()
        self.daemons.pop(host, None)

    def _last_checkpoint(self) -> str | None:
        best: tuple[float, str] | None = None
        for worker in self.workers:
            event = worker.last("checkpoint")
            if event is not None and (best is None or event["t"] > best[0]):
                best = (float(event["t"]), str(event["path"]))
        return None if best is None else best[1]

    # --- events -----------------------------------------------------------------------------
    def _schedule(self) -> list[tuple[float, str, int, float]]:
        plan = []
        for event in self.scenario.events:
            host = event.host_index(self.cfg.hosts)
            start = "preempt" if event.kind == "preempt" else "slow"
            plan.append((self.start_at + event.at * self.cfg.budget_s, start, host,
                         event.factor))
            if event.until is not None:
                back = "restore" if event.kind == "preempt" else "rate-restore"
                plan.append((self.start_at + event.until * self.cfg.budget_s, back, host, 1.0))
        return sorted(plan)

    def _apply(self, kind: str, host: int, factor: float) -> None:
        t0 = time.time()
        link = self.topo.hosts[host].link
        if kind in ("slow", "rate-restore"):
            self.topo.set_rate(self.topo.hosts[host], link.rate_mbit * factor)
        elif kind == "preempt":
            self.down.add(host)
            self._kill(host, "preempted")
            if self.system in DDP_SYSTEMS:
                self._ddp_restart(f"host {host} preempted")
        elif kind == "restore":
            self.down.discard(host)
            if self.system in DDP_SYSTEMS:
                self._ddp_restart(f"host {host} back")
            else:
                if self.system in DAEMON_SYSTEMS:
                    self._start_daemons(host)
                self._launch(host, time.time(), rejoin=True)
        self.actions.append({"t": t0, "kind": kind, "host": host, "factor": factor,
                             "seconds": time.time() - t0})
        self.say(f"t={t0 - self.start_at:6.1f}s {kind} host {host}"
                 f"{f' x{factor:g}' if kind == 'slow' else ''} ({time.time() - t0:.1f} s)")

    def _ddp_restart(self, why: str) -> None:
        """What torchrun elastic does on a membership change: stop every worker, start the
        members from the last checkpoint with a new world (the new generation)."""
        for host in list(self.current):
            self._kill(host, f"elastic restart: {why}")
        self.ddp_generation += 1
        self.ddp_world = [i for i in range(self.cfg.hosts) if i not in self.down]
        now = time.time()
        for host in self.ddp_world:
            self._launch(host, now, rejoin=False)

    # --- the run ----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        self.shared.mkdir(parents=True, exist_ok=True)
        self.start_file.unlink(missing_ok=True)  # an earlier run's in the same --out
        for host in self.topo.hosts:
            self.topo.set_rate(host, host.link.rate_mbit)
        sampler = Sampler(self.topo, cfg.sample_every_s)
        try:
            if self.system in DAEMON_SYSTEMS:
                for i in range(cfg.hosts):
                    self._start_daemons(i)
            self.ddp_world = list(range(cfg.hosts))
            launched = time.time()
            for i in range(cfg.hosts):
                self._launch(i, None, rejoin=False)
            self._wait_ready(launched)
            # every host starts together: the start file, written whole, says when
            self.start_at = time.time() + 1.0
            self.end_at = self.start_at + cfg.budget_s
            tmp = self.start_file.with_suffix(".tmp")
            tmp.write_text(repr(self.start_at))
            tmp.replace(self.start_file)
            self.say(f"every host ready {self.start_at - launched - 1:.1f} s after launch")
            sampler.start()
            self.tx_at_start = [self.topo.counters(h)[0] for h in self.topo.hosts]
            self._supervise()
        finally:
            for i in list(self.current):
                self._kill(i, "run over")
            for host in self.topo.hosts:  # whatever is left (daemons of a failed start)
                self.topo.kill_host(host)
            sampler.stop()
        record = {"scenario": self.scenario.name, "system": self.system, "seed": cfg.seed,
                  "trainers_per_host": cfg.trainers_per_host, "peers": self.layout.peers,
                  "config": cfg.to_json(), "start_at": self.start_at, "end_at": self.end_at,
                  "hosts": [{"ip": h.ip, "rate_mbit": h.link.rate_mbit,
                             "delay_s": h.link.delay_s, "loss_pct": h.link.loss_pct}
                            for h in self.topo.hosts],
                  "actions": self.actions, "samples": sampler.rows,
                  "workers": [w.to_json() for w in self.workers]}
        (self.dir / "run.json").write_text(json.dumps(record))
        return record

    def _wait_ready(self, launched: float) -> None:
        """Until every worker said `ready` (startup is not timed, so no host starts late)."""
        while True:
            workers = self._live()
            if all(w.last("ready") is not None for w in workers):
                return
            for worker in workers:
                if not worker.alive():
                    worker.finish()
                    raise RuntimeError(f"host {worker.host} exited ({worker.returncode}) before "
                                       f"it was ready: {worker.last('error')}\n"
                                       f"{worker.log_tail(15)}")
            if time.time() - launched > self.cfg.startup_s:
                late = [w.host for w in workers if w.last("ready") is None]
                raise RuntimeError(f"hosts {late} not ready {self.cfg.startup_s:g} s after "
                                   "launch")
            time.sleep(0.1)

    def _supervise(self) -> None:
        plan = self._schedule()
        next_report = self.start_at + 10
        while True:
            now = time.time()
            while plan and plan[0][0] <= now:
                _, kind, host, factor = plan.pop(0)
                self._apply(kind, host, factor)
            for worker in self._live():
                if not worker.alive() and worker.returncode is None:
                    worker.finish()
                    error = worker.last("error")
                    if worker.returncode != 0 or error is not None:
                        self.say(f"host {worker.host} g{worker.gen} exited "
                                 f"{worker.returncode}: {error or ''}\n{worker.log_tail(8)}")
            if now >= next_report:
                next_report += 10
                self._report(now)
            # a worker that said `done` has nothing left to report: its teardown (hivemind's
            # can take tens of seconds) is not waited for
            live = [w for w in self._live() if w.alive() and not self._finished(w, now)]
            if now >= self.end_at and (not live or now >= self.end_at + self.cfg.final_grace_s):
                if live:
                    self.say(f"hosts {[w.host for w in live]} still running "
                             f"{self.cfg.final_grace_s:g} s after the budget: killed")
                return
            if not live and not plan and now >= self.start_at:
                self.say("every worker exited before the budget ended")
                return
            time.sleep(0.2)

    def _live(self) -> list[WorkerProcess]:
        """Every trainer of the hosts that are up (whether it still runs or not)."""
        return [w for workers in self.current.values() for w in workers]

    @staticmethod
    def _finished(worker: WorkerProcess, now: float) -> bool:
        done = worker.last("done")
        return done is not None and now - float(done["recv"]) > DONE_EXIT_S

    def _report(self, now: float) -> None:
        parts = []
        for host in range(self.cfg.hosts):
            workers = self.current.get(host)
            if workers is None:
                parts.append(f"h{host}: down")
                continue
            progress = [w.last("progress") for w in workers]
            samples = sum(p.get("samples", 0) for p in progress if p)
            ok = sum(w.count("sync", ok=True) for w in workers)
            bad = sum(w.count("sync", ok=False) for w in workers)
            parts.append(f"h{host}: {samples} smp {ok}/{ok + bad} sync")
        with contextlib.suppress(Exception):
            tx = [(self.topo.counters(h)[0] - sent) / 1e6
                  for h, sent in zip(self.topo.hosts, self.tx_at_start, strict=True)]
            parts.append("MB sent " + " ".join(f"{x:.1f}" for x in tx))
        self.say(f"t={now - self.start_at:6.1f}s " + "; ".join(parts))
