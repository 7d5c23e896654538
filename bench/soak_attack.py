"""The churn soak under attack: `python -m bench.soak --attack`.

Two phases of the same soak (bench/soak.py: the same peers, rounds and seed, so the same
daemons are killed at the same moments), each beside a companion in a CPU cgroup of its own
with the same quota (`--attack-cores`, 0.5 of a core by default):

- A, the burner: a process that only spins. It takes from the machine what the attacker
  takes, so that B against A measures what the attack does to the daemons, not the CPU it
  uses.
- B, the attacker (`python -m bench.attacks.run`): a rotating mix of a stranger's attacks and a
  swarm member's (bench/attacks/), `--slot` seconds each in turn, flat out within its quota.

The churn stays on in both phases: the comparison is the soak as it is, with and without an
attacker beside it, and a daemon's defences must hold while peers come and go (a restarted
daemon is a new peer id, its declaration fresh, its replay cache empty). Every daemon holds
the swarm key in both phases; the attacker holds it too (it is a member gone bad) and reads
the daemons' addresses, the key and the tensors' schema from a file the soak rewrites whenever
a daemon restarts (what any member learns from the DHT). Its connections leave from an
address of its own (127.0.0.66), as another machine's would, so limits a daemon keeps per
address apply to it and not to the honest daemons beside it on 127.0.0.1.

Reported per phase: complete rounds per minute (rounds where every trainer but the killed
peer's got an exact result), results and failures, peak memory per daemon (VmHWM), loop stalls
(p99 from the daemons' moshpitd_event_loop_lag_seconds histograms, all daemons together; the
longest from their "event loop was blocked" warnings), and what the daemons refused. Goals:
B keeps RATIO_GOAL of A's complete rounds per minute, no daemon peaks above PEAK_MIB_GOAL, loop
stalls stay under STALL_P99_GOAL at p99; the exit status is 1 when one is missed (or a result
is corrupt, or a daemon not killed died), 2 without CPU cgroups (it needs root).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import mean
from typing import Any

from bench.attacks.targets import write_targets
from bench.cli import print_columns
from bench.daemon_watch import DaemonWatch
from bench.soak import ELEMENTS, ROUND_TIMEOUT, SOAK_KEY, Summary, run
from moshpitd.allreduce.layout import TensorSpec, schema_hash
from moshpitd.launcher import DaemonProcess
from netlab.cgroup import CpuGroup, cgroup_problem

RATIO_GOAL = 0.8
PEAK_MIB_GOAL = 300.0
STALL_P99_GOAL = 0.5
SCHEMA = schema_hash([TensorSpec("float64", (ELEMENTS,), 0)], encrypted=True,
                     checked=True)
ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT = 30.0


@dataclass(frozen=True)
class Setup:
    peers: int
    rounds: int
    seed: int = 0
    cores: float = 0.5  # the burner's and the attacker's CPU quota
    attacks: str = "all"  # the attacker's mix (bench.attacks.run --attacks)
    slot: float = 10.0  # s per attack in turn
    verbose: bool = False
    timeout: float = ROUND_TIMEOUT  # s a trainer waits for its round
    # turns of the whole mix the attacker must have completed before the last round's daemons
    # stop (a short run waits for them, after its rounds: they are not timed)
    rotations: int = 0
    log_level: str = "WARNING"  # the daemons'

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Setup:
        return cls(args.peers, args.rounds, args.seed, args.attack_cores, args.attacks,
                   args.slot, args.verbose, log_level=args.daemon_log_level)


@dataclass
class Phase:
    name: str
    summary: Summary
    daemons: dict[str, Any]  # DaemonWatch.report()
    cpu_seconds: float  # used by the companion's cgroup
    attacker: dict[str, Any] | None = None  # its report

    def report(self) -> dict[str, Any]:
        return {"soak": self.summary.report(), "daemons": self.daemons,
                "companion_cpu_seconds": round(self.cpu_seconds, 1), "attacker": self.attacker}


def swarm_key_file(directory: Path) -> Path:
    path = directory / "swarm.key"
    path.touch(0o600)
    path.chmod(0o600)  # (whatever the umask)
    path.write_text(os.urandom(32).hex())
    return path


def burner(cores: float) -> list[list[str]]:
    """Processes that spin: enough of them to use `cores` (the cgroup holds them to it)."""
    return [[sys.executable, "-c", "while True: pass"]] * max(1, -int(-cores // 1))


def attacker(setup: Setup, workdir: Path, key: Path) -> list[list[str]]:
    return [[sys.executable, "-m", "bench.attacks.run", "--targets", str(workdir / "targets.json"),
             "--swarm-key-file", str(key), "--attacks", setup.attacks, "--slot", str(setup.slot),
             "--seed", str(setup.seed), "--report", str(workdir / "attacker.json")]]


def run_phase(name: str, setup: Setup, workdir: Path, key: Path,
              companion: list[list[str]], ready: Callable[[], bool],
              done: Callable[[], bool] = lambda: True) -> Phase:
    """The soak, with `companion` started in a CPU cgroup of its own before the first round
    (once the daemons are up and published, and it is `ready`) and stopped after the last
    (once it is `done`, at most READY_TIMEOUT later)."""
    workdir.mkdir(parents=True)
    group = CpuGroup(f"moshpit-soak-{os.getpid()}-{name}", setup.cores).create()
    watch = DaemonWatch()
    procs: list[subprocess.Popen[bytes]] = []
    log = open(workdir / f"{name}.log", "ab")  # noqa: SIM115 - closed below

    def wait(until: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while not until():
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"the {name} {what}: see {workdir / name}.log")
            time.sleep(0.05)

    observed = [0]

    def observe(daemons: list[DaemonProcess]) -> None:
        write_targets(workdir / "targets.json", SOAK_KEY, SCHEMA,
                      [{**d.info, "name": d.name} for d in daemons if d.alive()])
        if not procs:
            procs.extend(subprocess.Popen(group.join_command(cmd), cwd=ROOT, stdout=log,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                         for cmd in companion)
            wait(ready, "did not start")
        observed[0] += 1
        if observed[0] > setup.rounds:  # after the last round
            wait(done, "did not finish its turns")
        watch.observe(daemons)

    try:
        summary = run(setup.peers, setup.rounds, setup.seed, workdir / "swarm", setup.verbose,
                      ["--swarm-key-file", str(key)], observe, setup.timeout,
                      setup.log_level)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(20)
        cpu = group.cpu_seconds()
        group.remove()  # kills whatever did not stop
        log.close()
    report = workdir / "attacker.json"
    return Phase(name, summary, watch.report(), cpu,
                 json.loads(report.read_text()) if report.exists() else None)


@dataclass
class Comparison:
    setup: Setup
    burner: Phase
    attack: Phase

    def goals(self) -> dict[str, Any]:
        a, b = self.burner, self.attack
        rate = [p.summary.report()["complete_per_minute"] for p in (a, b)]
        ratio = rate[1] / rate[0] if rate[0] else 0.0
        peak = max(a.daemons["peak_mib_max"], b.daemons["peak_mib_max"])
        stall = b.daemons["stall_p99_s"]
        return {"ratio": round(ratio, 3), "ratio_ok": ratio >= RATIO_GOAL,
                "peak_mib": peak, "peak_ok": peak <= PEAK_MIB_GOAL,
                "stall_p99_s": stall, "stall_ok": stall < STALL_P99_GOAL}

    @property
    def sound(self) -> bool:
        """No corrupt result and no daemon died that was not killed, in either phase."""
        return all(p.summary.corrupt == 0 and p.summary.crashes == 0
                   for p in (self.burner, self.attack))

    @property
    def ok(self) -> bool:
        met = self.goals()
        return self.sound and met["ratio_ok"] and met["peak_ok"] and met["stall_ok"]

    def report(self) -> dict[str, Any]:
        return {"setup": asdict(self.setup), "burner": self.burner.report(),
                "attack": self.attack.report(), "goals": self.goals(), "ok": self.ok}


def compare(setup: Setup, workdir: Path) -> Comparison:
    """Phase A beside the burner, then phase B beside the attacker (needs CPU cgroups)."""
    key = swarm_key_file(workdir)
    a = run_phase("burner", setup, workdir / "a", key, burner(setup.cores), lambda: True)
    b_dir = workdir / "b"
    report = b_dir / "attacker.json"
    b = run_phase("attacker", setup, b_dir, key, attacker(setup, b_dir, key), report.exists,
                  lambda: json.loads(report.read_text())["rotations"] >= setup.rotations)
    return Comparison(setup, a, b)


def by_attack(timeline: list[tuple[float, float, float, bool]],
              slots: list[tuple[str, float, float]]) -> dict[str, list[float]]:
    """Per attack: the rounds that began in its slots, and their mean seconds averaging and
    restarting the killed peer (what each attack costs the soak, attributed by the clock)."""
    rounds: dict[str, list[tuple[float, float]]] = {}
    for began, averaging, restarting, _ in timeline:
        for name, start, end in slots:
            if start <= began < end:
                rounds.setdefault(name, []).append((averaging, restarting))
                break
    return {name: [len(got), *(sum(x) / len(got) for x in zip(*got, strict=True))]
            for name, got in rounds.items()}


def print_report(c: Comparison) -> None:
    setup, a, b, met = c.setup, c.burner, c.attack, c.goals()
    print(f"{setup.peers} peers, {setup.rounds} rounds a phase (seed {setup.seed}), one SIGKILL "
          f"+ restart per round; beside them {setup.cores:g} core of a burner (A), "
          f"then of an attacker (B)")
    ra, rb = a.summary.report(), b.summary.report()
    da, db = a.daemons, b.daemons
    rows = [["", "A: burner", "B: attack"]]
    for title, key in (("complete rounds / min", "complete_per_minute"),
                       ("complete rounds", "complete"), ("results", "results"),
                       ("failures", "failures"), ("corrupt results", "corrupt"),
                       ("crashes (not killed)", "crashes"), ("wall s", "wall_seconds")):
        rows.append([title, str(ra[key]), str(rb[key])])
    rows.append(["round time p50 / p95 s", f"{ra['p50_seconds']:.2f} / {ra['p95_seconds']:.2f}",
                 f"{rb['p50_seconds']:.2f} / {rb['p95_seconds']:.2f}"])
    for title, key in (("peak MiB per daemon, max", "peak_mib_max"),
                       ("peak MiB per daemon, median", "peak_mib_median"),
                       ("loop stall p99 s", "stall_p99_s"), ("loop stall max s", "stall_max_s"),
                       ("stalls logged (> 0.25 s)", "stalls_logged")):
        rows.append([title, str(da[key]), str(db[key])])
    rows.append(["companion CPU s", f"{a.cpu_seconds:.0f}", f"{b.cpu_seconds:.0f}"])
    print_columns(rows)
    print(f"B / A: {met['ratio']:.2f} (goal >= {RATIO_GOAL}); peak {met['peak_mib']} MiB (goal "
          f"<= {PEAK_MIB_GOAL:.0f}); stall p99 {met['stall_p99_s']} s (goal < {STALL_P99_GOAL})")
    if b.attacker is not None:
        print("attacks (B):")
        for attack, got in b.attacker["attacks"].items():
            counts = ", ".join(f"{k} {v}" for k, v in got["counts"].items())
            print(f"  {attack} ({got['seconds']:.0f} s): {counts}")
        a_rounds = a.summary.timeline
        if a_rounds:
            print(f"  s averaging / restarting per round, mean: A "
                  f"{mean(r[1] for r in a_rounds):.2f} / {mean(r[2] for r in a_rounds):.2f}; "
                  f"B by the attack it began under:")
        for name, (n, averaging, restarting) in by_attack(b.summary.timeline,
                                                          b.attacker["slots"]).items():
            print(f"    {name}: {averaging:.2f} / {restarting:.2f} ({n:.0f} rounds)")
        if b.attacker["errors"]:
            print(f"  attacker errors: {b.attacker['errors']}")
    print(f"daemons refused (A): {da['refusals']}")
    print(f"daemons refused (B): {db['refusals']}")
    for phase in (a, b):
        for line in phase.summary.problems[:10]:
            print(f"  {phase.name}: {line}")


def main(args: argparse.Namespace, workdir: Path) -> int:
    problem = cgroup_problem()
    if problem is not None:
        print(f"bench.soak --attack needs a CPU cgroup for the burner and the attacker: "
              f"{problem}", file=sys.stderr)
        return 2
    c = compare(Setup.from_args(args), workdir)
    if args.json:
        print(json.dumps(c.report()))
    else:
        print_report(c)
    return 0 if c.ok else 1
