"""Churn soak: N daemons average round after round while one random daemon per round is
SIGKILLed mid-round and restarted.

Checks, every round: no other daemon died; every result is exact where it claims to be (each
span of the result equals the mean of the contributions its member mask names, or the peer's
own value where the mask is 0); the killed peer's trainer gets an error, never a wrong tensor.
Prints rounds completed, mean group size and p50/p95 round time.

    python -m bench.soak --peers 8 --rounds 50 [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import moshpit
from bench.cli import exit_on_sigterm, positive
from moshpitd.launcher import DaemonProcess, LocalSwarm, start_daemon

ELEMENTS = 200_000


@dataclass
class Summary:
    peers: int
    rounds: int
    results: int = 0  # peer-rounds that returned a tensor
    failures: int = 0  # peer-rounds that raised (the killed peer's, or no group in time)
    corrupt: int = 0  # results whose values are not what their spans claim
    crashes: int = 0  # daemons that died without being killed
    group_sizes: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def report(self) -> dict[str, Any]:
        secs = np.array(self.seconds or [0.0])
        out = asdict(self)
        out.pop("group_sizes")
        out.pop("seconds")
        out["problems"] = self.problems[:20]
        out["mean_group_size"] = float(np.mean(self.group_sizes)) if self.group_sizes else 0.0
        out["p50_seconds"] = float(np.percentile(secs, 50))
        out["p95_seconds"] = float(np.percentile(secs, 95))
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


def run(peers: int, rounds: int, seed: int, workdir: Path, verbose: bool) -> Summary:
    rng = random.Random(seed)
    summary = Summary(peers, rounds)
    with LocalSwarm(peers, workdir=workdir, log_level="WARNING") as swarm:
        daemons: list[DaemonProcess] = list(swarm.daemons)
        restarts = [0] * peers
        for rnd in range(rounds):
            peer_of = {d.info["peer_id"]: i for i, d in enumerate(daemons)}
            victim = rng.randrange(peers)
            delay = rng.uniform(0.0, 0.08)
            outcome: list[Any] = [None] * peers

            def trainer(i: int, outcome: list[Any] = outcome) -> None:
                began = time.monotonic()
                try:
                    with moshpit.Client(daemons[i].socket, connect_timeout=5.0) as c:
                        t = torch.from_numpy(contribution(i))
                        (out,) = c.average([t], key="soak", group_size=peers, timeout=8.0)
                        outcome[i] = (out.numpy(), c.last_round, time.monotonic() - began)
                except moshpit.MoshpitError as exc:
                    outcome[i] = exc

            threads = [threading.Thread(target=trainer, args=(i,)) for i in range(peers)]
            for th in threads:
                th.start()
            time.sleep(delay)
            daemons[victim].kill()  # SIGKILL, somewhere in matchmaking or the all-reduce
            for th in threads:
                th.join(60)
            for i, d in enumerate(daemons):
                if i != victim and not d.alive():
                    summary.crashes += 1
                    summary.problems.append(f"round {rnd}: daemon {i} died:\n{d.log_tail(20)}")
            for i, got in enumerate(outcome):
                if isinstance(got, tuple):
                    result, info, seconds = got
                    problem = check(result, i, info, peer_of)
                    if problem is not None:
                        summary.corrupt += 1
                        summary.problems.append(f"round {rnd} peer {i}: {problem}")
                    summary.results += 1
                    summary.group_sizes.append(info.group_size)
                    summary.seconds.append(seconds)
                else:
                    summary.failures += 1
            # the victim comes back as a fresh daemon (new peer id) on its own socket
            restarts[victim] += 1
            alive = [d.dht for d in daemons if d.alive()][:3]
            daemons[victim] = start_daemon(f"d{victim}r{restarts[victim]}", swarm.workdir,
                                           alive, "WARNING")
            swarm.daemons.append(daemons[victim])
            if verbose:
                sizes = [o[1].group_size if isinstance(o, tuple) else 0 for o in outcome]
                print(f"round {rnd:3d}: killed {victim} after {delay * 1000:.0f} ms; "
                      f"group sizes {sizes}", flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", type=positive, default=8)
    p.add_argument("--rounds", type=positive, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    exit_on_sigterm()
    with tempfile.TemporaryDirectory(prefix="moshpit-soak-") as tmp:
        summary = run(args.peers, args.rounds, args.seed, Path(tmp), args.verbose)
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
