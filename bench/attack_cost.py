"""What each attack alone costs honest rounds: `python -m bench.attack_cost` (root: cgroups).

The soak under attack (bench/soak_attack.py) rotates every attack through one run with churn,
so its ratio mixes them, and moves by a tenth from run to run. This bench isolates them: one
swarm of `--peers` daemons with a swarm key, whose trainers average back to back, with no
kills; each attack in turn runs alone from its own CPU cgroup (`--cores`) for `--seconds`, and
the rounds are measured during it and again for as long right after it (what it leaves
behind: records, shunned peers, held connections). A first phase without any attack is the
baseline.

Per phase: rounds completed, round time p50 and max (the slowest trainer of each round),
trainers that failed, and the daemons' CPU seconds against the attacker's (how much work one
core of attack makes the daemons do).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import moshpit
from bench.attacks.run import BY_NAME
from bench.attacks.targets import write_targets
from bench.cli import positive, print_columns
from bench.soak_attack import SCHEMA, swarm_key_file
from moshpitd.launcher import DaemonProcess, LocalSwarm
from netlab.cgroup import CpuGroup, cgroup_problem

KEY = "soak"  # the key and schema the attacker's records target (bench/soak_attack.py)
ELEMENTS = 200_000
TIMEOUT = 8.0  # s a trainer waits for its round


@dataclass
class Rounds:
    seconds: list[float] = field(default_factory=list)  # each round's slowest trainer
    failures: list[str] = field(default_factory=list)

    def row(self) -> list[str]:
        s = self.seconds or [float("nan")]
        return [str(len(self.seconds)), f"{np.median(s):.2f}", f"{max(s):.2f}",
                str(len(self.failures))]


def rounds(daemons: list[DaemonProcess], seconds: float) -> Rounds:
    """Rounds of every daemon's trainer at once, back to back, for `seconds`."""
    out = Rounds()
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        took: list[float | None] = [None] * len(daemons)

        def trainer(i: int, took: list[float | None] = took) -> None:
            began = time.monotonic()
            try:
                with moshpit.Client(daemons[i].socket, connect_timeout=5.0) as c:
                    c.average([torch.full((ELEMENTS,), float(i), dtype=torch.float64)], key=KEY,
                              group_size=len(daemons), timeout=TIMEOUT)
                took[i] = time.monotonic() - began
            except moshpit.MoshpitError as exc:
                out.failures.append(f"daemon {i}: {exc}"[:300])

        threads = [threading.Thread(target=trainer, args=(i,)) for i in range(len(daemons))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        done = [t for t in took if t is not None]
        if done:
            out.seconds.append(max(done))
    return out


def cpu_seconds(daemons: list[DaemonProcess]) -> float:
    total = 0
    for d in daemons:
        with open(f"/proc/{d.proc.pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        total += int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks
    return total / os.sysconf("SC_CLK_TCK")


def measure(attacks: list[str], peers: int, seconds: float, cores: float, workdir: Path
            ) -> list[list[str]]:
    key = swarm_key_file(workdir)
    rows = [["attack", "rounds", "p50 s", "max s", "failed", "after: rounds", "p50 s",
             "failed", "daemons CPU s", "attacker CPU s"]]
    with LocalSwarm(peers, workdir=workdir / "swarm", log_level="WARNING",
                    extra_args=["--swarm-key-file", str(key)]) as swarm:
        daemons = list(swarm.daemons)
        targets = workdir / "targets.json"
        write_targets(targets, KEY, SCHEMA, [{**d.info, "name": d.name} for d in daemons])
        rounds(daemons, 1.0)  # warm: contacts proven, sessions open
        used = cpu_seconds(daemons)
        base = rounds(daemons, seconds)
        rows.append(["none", *base.row(), "", "", "", f"{cpu_seconds(daemons) - used:.1f}", ""])
        for name in attacks:
            group = CpuGroup(f"moshpit-attack-cost-{os.getpid()}-{name}", cores).create()
            report = workdir / f"{name}.json"
            proc = subprocess.Popen(group.join_command(
                [sys.executable, "-m", "bench.attacks.run", "--targets", str(targets),
                 "--swarm-key-file", str(key), "--attacks", name, "--slot", "1e9",
                 "--report", str(report)]), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + 30
                while not report.exists():  # written once the attacker is up
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the {name} attacker did not start")
                    time.sleep(0.05)
                used, attacker = cpu_seconds(daemons), group.cpu_seconds()
                during = rounds(daemons, seconds)
                used, attacker = cpu_seconds(daemons) - used, group.cpu_seconds() - attacker
            finally:
                proc.terminate()
                proc.wait(20)
                group.remove()
            after = rounds(daemons, seconds)
            rows.append([name, *during.row(), *after.row()[:2], after.row()[3],
                         f"{used:.1f}", f"{attacker:.1f}"])
            for line in (during.failures + after.failures)[:3]:
                print(f"  {name}: {line}", flush=True)
            if not all(d.alive() for d in daemons):
                raise RuntimeError(f"a daemon died under {name}")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attacks", default=",".join(BY_NAME),
                   help=f"comma-separated (default: all): {','.join(BY_NAME)}")
    p.add_argument("--peers", type=positive, default=4)
    p.add_argument("--seconds", type=float, default=10.0, help="per phase")
    p.add_argument("--cores", type=float, default=0.5, help="the attacker's CPU quota")
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args(argv)
    problem = cgroup_problem()
    if problem is not None:
        print(f"bench.attack_cost runs each attacker in a CPU cgroup: {problem}",
              file=sys.stderr)
        return 2
    attacks = [a.strip() for a in args.attacks.split(",") if a.strip()]
    unknown = [a for a in attacks if a not in BY_NAME]
    if unknown:
        p.error(f"unknown attack(s) {unknown}; known: {list(BY_NAME)}")
    with tempfile.TemporaryDirectory(prefix="attack-cost-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        print(f"{args.peers} daemons averaging {ELEMENTS} float64 back to back; each attack "
              f"alone for {args.seconds:g} s from {args.cores:g} core, then {args.seconds:g} s "
              f"after it", flush=True)
        print_columns(measure(attacks, args.peers, args.seconds, args.cores, workdir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
