"""Churn soak: N daemons average round after round while one random daemon per round is
SIGKILLed mid-round and restarted.

Checks, every round: no other daemon died; every result is exact where it claims to be (each
span of the result equals the mean of the contributions its member mask names, or the peer's
own value where the mask is 0); the killed peer's trainer gets an error, never a wrong tensor.
Prints rounds completed, mean group size and p50/p95 round time.

    python -m bench.soak --peers 8 --rounds 50 [--json]

With --attack (root: CPU cgroups), the same soak twice, beside a CPU burner and then beside an
attacker with the same CPU quota, compared (bench/soak_attack.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import moshpit
from bench.cli import exit_on_sigterm, positive
from moshpitd.launcher import DaemonProcess, LocalSwarm, start_daemon

ELEMENTS = 200_000
SOAK_KEY = "soak"
ROUND_TIMEOUT = 8.0  # s a trainer waits for its round


@dataclass
class Summary:
    peers: int
    rounds: int
    complete: int = 0  # rounds where every trainer but the killed peer's got an exact result
    wall_seconds: float = 0.0  # from the first round's start to the last one's end
    results: int = 0  # peer-rounds that returned a tensor
    failures: int = 0  # peer-rounds that raised (the killed peer's, or no group in time)
    corrupt: int = 0  # results whose values are not what their spans claim
    crashes: int = 0  # daemons that died without being killed
    group_sizes: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    # per round: (wall clock at its start, s averaging, s restarting the killed peer, complete)
    timeline: list[tuple[float, float, float, bool]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def report(self) -> dict[str, Any]:
        secs = np.array(self.seconds or [0.0])
        out = asdict(self)
        out.pop("group_sizes")
        out.pop("seconds")
        out["timeline"] = [(round(t, 3), round(a, 3), round(r, 3), c)
                           for t, a, r, c in self.timeline]
        out["problems"] = self.problems[:20]
        out["mean_group_size"] = float(np.mean(self.group_sizes)) if self.group_sizes else 0.0
        out["p50_seconds"] = float(np.percentile(secs, 50))
        out["p95_seconds"] = float(np.percentile(secs, 95))
        out["wall_seconds"] = round(self.wall_seconds, 2)
        out["complete_per_minute"] = round(self.complete / max(self.wall_seconds, 1e-9) * 60, 2)
        return out


def contribution(peer: int, size: int = ELEMENTS) -> np.ndarray:
    """Distinct per peer and per element, exact in float64, so any mixing shows."""
    return peer * 1000.0 + np.arange(size, dtype=np.float64)


def check(result: np.ndarray, own: int, info: moshpit.RoundInfo, peer_of: dict[str, int]
          ) -> str | None:
    """None if every span holds the mean of the contributions its mask names."""
    covered = 0
    for start, stop, mask in info.spans:
        if mask == 0:
            want = contribution(own)[start:stop]
        else:
            members = [peer_of.get(pid) for i, pid in enumerate(info.members) if mask >> i & 1]
            if None in members:
                return f"span {start}:{stop} names a peer id that is not in the swarm"
            want = np.mean([contribution(m)[start:stop] for m in members  # type: ignore[arg-type]
                            ], axis=0)
        # 1e-12 relative: float64 rounding of the sum, while one member more or less moves an
        # element by at least 1000 / peers
        off = ~np.isclose(result[start:stop], want, rtol=1e-12, atol=0.0)
        if off.any():
            bad = int(np.argmax(off)) + start
            return f"element {bad}: {result[bad]} != {want[bad - start]} (mask {mask:b})"
        covered += stop - start
    if covered != len(result):
        return f"spans cover {covered} of {len(result)} elements"
    return None


Observer = Callable[[list[DaemonProcess]], None]


def run(peers: int, rounds: int, seed: int, workdir: Path, verbose: bool,
        extra_args: list[str] | None = None, observe: Observer | None = None,
        timeout: float = ROUND_TIMEOUT, log_level: str = "WARNING") -> Summary:
    """`extra_args` go to every daemon, restarted ones too; `observe` is shown the daemons
    before every round (after the last killed one is back) and once after the last round;
    `timeout` is each trainer's for its round; `log_level` the daemons'."""
    rng = random.Random(seed)
    summary = Summary(peers, rounds)
    with LocalSwarm(peers, workdir=workdir, log_level=log_level,
                    extra_args=extra_args) as swarm:
        daemons: list[DaemonProcess] = list(swarm.daemons)
        restarts = [0] * peers
        began = time.monotonic()
        for rnd in range(rounds):
            observed = time.monotonic()
            if observe is not None:
                observe(daemons)
            if rnd == 0:
                began = time.monotonic()  # (the first observe may wait for an attacker)
            peer_of = {d.info["peer_id"]: i for i, d in enumerate(daemons)}
            victim = rng.randrange(peers)
            delay = rng.uniform(0.0, 0.08)
            outcome: list[Any] = [None] * peers

            def trainer(i: int, outcome: list[Any] = outcome) -> None:
                began = time.monotonic()
                try:
                    with moshpit.Client(daemons[i].socket, connect_timeout=5.0) as c:
                        t = torch.from_numpy(contribution(i))
                        (out,) = c.average([t], key=SOAK_KEY, group_size=peers,
                                            timeout=timeout)
                        outcome[i] = (out.numpy(), c.last_round, time.monotonic() - began)
                except moshpit.MoshpitError as exc:
                    outcome[i] = exc

            threads = [threading.Thread(target=trainer, args=(i,)) for i in range(peers)]
            for th in threads:
                th.start()
            started, wall = time.monotonic(), time.time()
            time.sleep(delay)
            daemons[victim].kill()  # SIGKILL, somewhere in matchmaking or the all-reduce
            for th in threads:
                th.join(60)
            for i, d in enumerate(daemons):
                if i != victim and not d.alive():
                    summary.crashes += 1
                    summary.problems.append(f"round {rnd}: daemon {i} died:\n{d.log_tail(20)}")
            exact = 0
            for i, got in enumerate(outcome):
                if isinstance(got, tuple):
                    result, info, seconds = got
                    problem = check(result, i, info, peer_of)
                    if problem is not None:
                        summary.corrupt += 1
                        summary.problems.append(f"round {rnd} peer {i}: {problem}")
                    else:
                        exact += i != victim
                    summary.results += 1
                    summary.group_sizes.append(info.group_size)
                    summary.seconds.append(seconds)
                else:
                    summary.failures += 1
            summary.complete += exact == peers - 1
            averaged = time.monotonic()
            # the victim comes back as a fresh daemon (new peer id) on its own socket
            restarts[victim] += 1
            alive = [d.dht for d in daemons if d.alive()][:3]
            daemons[victim] = start_daemon(f"d{victim}r{restarts[victim]}", swarm.workdir,
                                           alive, log_level, extra_args)
            swarm.daemons.append(daemons[victim])
            summary.timeline.append((wall, averaged - started, time.monotonic() - averaged,
                                     exact == peers - 1))
            if verbose:
                sizes = [o[1].group_size if isinstance(o, tuple) else 0 for o in outcome]
                print(f"round {rnd:3d}: killed {victim} after {delay * 1000:.0f} ms; "
                      f"group sizes {sizes}; s observing {started - observed:.2f}, averaging "
                      f"{averaged - started:.2f}, restarting {time.monotonic() - averaged:.2f}",
                      flush=True)
                for i, got in enumerate(outcome):  # a peer that was not killed and failed
                    if i != victim and not isinstance(got, tuple):
                        print(f"           peer {i}: {got!r}"[:400], flush=True)
        summary.wall_seconds = time.monotonic() - began
        if observe is not None:
            observe(daemons)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", type=positive, default=8)
    p.add_argument("--rounds", type=positive, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--daemon-log-level", default="WARNING", type=str.upper,
                   help="the daemons' log level (their logs stay in --workdir)")
    p.add_argument("--workdir", type=Path, help="keep the daemons' logs here (default: a "
                   "temporary directory, removed)")
    g = p.add_argument_group("under attack (bench/soak_attack.py; needs root for cgroups)")
    g.add_argument("--attack", action="store_true",
                   help="run the soak beside a CPU burner, then beside an attacker, and compare")
    g.add_argument("--attack-cores", type=float, default=0.5,
                   help="CPU quota of the burner and of the attacker, in cores")
    g.add_argument("--attacks", default="all",
                   help="the attacker's mix: all, or comma-separated names (bench.attacks.run)")
    g.add_argument("--slot", type=float, default=10.0, help="seconds per attack in turn")
    args = p.parse_args(argv)
    exit_on_sigterm()
    with contextlib.ExitStack() as stack:
        if args.workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(
                prefix="moshpit-soak-")))
        else:
            workdir = args.workdir
            workdir.mkdir(parents=True)
        if args.attack:
            from bench import soak_attack
            return soak_attack.main(args, workdir)
        summary = run(args.peers, args.rounds, args.seed, workdir, args.verbose,
                      log_level=args.daemon_log_level)
    report = summary.report()
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{args.peers} peers, {args.rounds} rounds, one SIGKILL + restart per round")
        print(f"  results {report['results']}, failures {report['failures']} "
              f"(the killed peer's own, or no group in time)")
        print(f"  corrupt results {report['corrupt']}, crashes of other daemons "
              f"{report['crashes']}")
        print(f"  mean group size {report['mean_group_size']:.2f}, round time p50 "
              f"{report['p50_seconds']:.3f} s, p95 {report['p95_seconds']:.3f} s")
        for line in report["problems"]:
            print("  " + line)
    return 0 if summary.corrupt == 0 and summary.crashes == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
