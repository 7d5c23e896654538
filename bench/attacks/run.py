"""The attacker: a rotating mix of attacks against the daemons a targets file names, until
SIGTERM. Each attack in turn has the attacker for `--slot` seconds (the order shuffled once by
`--seed`), working flat out: its rate is what the CPU quota of the cgroup it runs in allows.

    python -m bench.attacks.run --targets T.json [--swarm-key-file K] [--attacks a,b]
        [--slot 10] [--source 127.0.0.66] [--report R.json]

Without a swarm key only the stranger's attacks run. The report (rewritten after every slot,
and at exit) gives, per attack, the seconds it ran and what it sent and got back."""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

from bench.attacks.loop import LoopThread
from bench.attacks.member_dht import Declarations, RunRecords, SealedFlood
from bench.attacks.member_groups import HelloFlood, JoinFlood, StallingLeader
from bench.attacks.mix import Attack, Env
from bench.attacks.stranger import GrpcJunk, UdpJunk, ZeroWindow
from bench.attacks.targets import TargetsFile
from moshpitd.auth import SwarmKey

ATTACKS: list[type[Attack]] = [GrpcJunk, ZeroWindow, UdpJunk, SealedFlood, RunRecords,
                               Declarations, StallingLeader, JoinFlood, HelloFlood]
BY_NAME = {a.name: a for a in ATTACKS}
SOURCE = "127.0.0.66"  # the attacker's own address: per-address limits see it apart


def parse_attacks(text: str) -> list[type[Attack]]:
    if text == "all":
        return list(ATTACKS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown attack(s) {unknown}; known: {list(BY_NAME)}")
    return [BY_NAME[n] for n in names]


class Attacker:
    def __init__(self, attacks: list[Attack], targets: TargetsFile, slot: float,
                 report: Path | None) -> None:
        self.attacks, self.targets, self.slot, self.report_path = attacks, targets, slot, report
        self.seconds: dict[str, float] = {}
        self.slots: list[tuple[str, float, float]] = []  # (attack, wall start, wall end)
        self.errors: Counter[str] = Counter()
        self.rotations = 0  # turns of the whole mix completed
        self.stopping = threading.Event()

    def run(self) -> None:
        turn = 0
        while not self.stopping.is_set():
            attack = self.attacks[turn % len(self.attacks)]
            turn += 1
            began, wall = time.monotonic(), time.time()
            try:
                while time.monotonic() - began < self.slot and not self.stopping.is_set():
                    try:
                        attack.step(self.targets.read())
                    except Exception as exc:  # a daemon killed under it, or a bug: go on
                        self._error(attack, exc)
                        time.sleep(0.05)
            finally:
                try:
                    attack.stop()
                except Exception as exc:
                    self._error(attack, exc)
                self.seconds[attack.name] = (self.seconds.get(attack.name, 0.0)
                                             + time.monotonic() - began)
                self.slots.append((attack.name, round(wall, 3), round(time.time(), 3)))
                self.rotations += turn % len(self.attacks) == 0
                self.write_report()

    def _error(self, attack: Attack, exc: Exception) -> None:
        what = f"{attack.name}: {type(exc).__name__}"
        if not self.errors[what]:  # the first of each kind, in full
            print(f"attacker: {what}\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        self.errors[what] += 1

    def report(self) -> dict[str, object]:
        return {"attacks": {a.name: {"seconds": round(self.seconds.get(a.name, 0.0), 2),
                                     "counts": dict(a.counts)} for a in self.attacks},
                "slots": self.slots, "rotations": self.rotations, "errors": dict(self.errors)}

    def write_report(self) -> None:
        if self.report_path is not None:
            tmp = self.report_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.report(), indent=1))
            os.replace(tmp, self.report_path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", type=Path, required=True, help="the file the soak publishes")
    p.add_argument("--swarm-key-file", default="", help="a member's key (default: a stranger)")
    p.add_argument("--attacks", type=parse_attacks, default=list(ATTACKS),
                   help=f"comma-separated, or all (default): {','.join(BY_NAME)}")
    p.add_argument("--slot", type=float, default=10.0, help="seconds per attack in turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--source", default=SOURCE, help="the address connections leave from")
    p.add_argument("--report", type=Path)
    args = p.parse_args(argv)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # it holds many connections
    key = SwarmKey.from_file(args.swarm_key_file) if args.swarm_key_file else None
    kinds = [a for a in args.attacks if key is not None or not a.needs_key]
    if not kinds:
        p.error("none of these attacks runs without --swarm-key-file")
    rng = random.Random(args.seed)
    rng.shuffle(kinds)
    deadline = time.monotonic() + 30
    while not args.targets.exists():  # the soak writes it once its daemons are up
        if time.monotonic() > deadline:
            p.error(f"{args.targets} did not appear within 30 s")
        time.sleep(0.05)
    loop = LoopThread()
    env = Env(key, loop, rng, args.source)
    attacker = Attacker([k(env) for k in kinds], TargetsFile(args.targets), args.slot,
                        args.report)
    signal.signal(signal.SIGTERM, lambda *_: attacker.stopping.set())
    signal.signal(signal.SIGINT, lambda *_: attacker.stopping.set())
    print(f"attacker: {', '.join(a.name for a in attacker.attacks)}, {args.slot:g} s each, "
          f"from {args.source}", flush=True)
    attacker.write_report()  # (its first appearance tells the soak the attacker is up)
    try:
        attacker.run()
    finally:
        attacker.write_report()
        env.egress.close()
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
