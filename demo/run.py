"""`make demo`: 4 daemons and 4 trainers on 127.0.0.1, averaging an MLP on sklearn's digits.

Trainers are separate processes started with subprocess (never forked); their output is streamed
here with a rank prefix. Everything started is stopped on the way out, also on Ctrl-C or at the
deadline: trainers in a finally block, then the daemons by LocalSwarm.__exit__.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from demo.model import save_split
from moshpitd.launcher import LaunchError, LocalSwarm

ROOT = Path(__file__).resolve().parent.parent
FINAL = re.compile(r"final accuracy ([0-9.]+), ([0-9]+) rounds ok")
_print_lock = threading.Lock()


def stream(rank: int, proc: subprocess.Popen[str], finals: dict[int, tuple[float, int]]) -> None:
    """Copy one trainer's output line by line, prefixing lines it did not prefix itself."""
    prefix = f"[rank {rank}] "
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        if match := FINAL.search(line):
            finals[rank] = (float(match.group(1)), int(match.group(2)))
        with _print_lock:
            print(line if line.startswith(prefix) else prefix + line, flush=True)


def start_trainer(rank: int, world: int, socket: str, data: Path,
                  extra: list[str]) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "demo.trainer", "--rank", str(rank), "--world", str(world),
           "--socket", socket, "--data", str(data), *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def stop_trainers(procs: list[subprocess.Popen[str]], grace: float = 5.0) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run(args: argparse.Namespace, extra: list[str]) -> int:
    started = time.monotonic()
    finals: dict[int, tuple[float, int]] = {}
    procs: list[subprocess.Popen[str]] = []
    codes: list[int | None] = []
    with LocalSwarm(args.world, args.workdir, args.log_level) as swarm:
        print(f"started {args.world} daemons in {time.monotonic() - started:.1f} s", flush=True)
        data = swarm.workdir / "digits.npz"  # split once here: trainers skip importing sklearn
        save_split(data)
        readers = []
        try:
            for rank, socket in enumerate(swarm.sockets):
                procs.append(start_trainer(rank, args.world, socket, data, extra))
                readers.append(threading.Thread(target=stream, args=(rank, procs[-1], finals),
                                                daemon=True))
                readers[-1].start()
            for proc in procs:
                try:
                    proc.wait(max(started + args.deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    print(f"trainers still running after {args.deadline:.0f} s: stopping them")
                    break
        finally:
            stop_trainers(procs)
            codes = [proc.returncode for proc in procs]
        for reader in readers:
            reader.join(5.0)
        for d in swarm.daemons:
            if not d.alive():
                print(f"daemon {d.name} died (exit {d.proc.returncode}):\n{d.log_tail()}")
    print(f"finished in {time.monotonic() - started:.1f} s")
    failed = False
    for rank in range(args.world):
        acc, ok = finals.get(rank, (None, 0))
        failed |= acc is None or codes[rank] != 0 or ok == 0
        print(f"trainer {rank}: exit {codes[rank]}, {ok} rounds averaged, final held-out "
              f"accuracy {'missing' if acc is None else f'{acc:.4f}'}")
    if failed:
        print("FAILED: not every trainer finished, with at least one averaged round")
        return 1
    mean = sum(acc for acc, _ in finals.values()) / args.world
    print(f"mean final held-out accuracy {mean:.4f}")
    if mean <= args.min_accuracy:
        print(f"FAILED: mean accuracy is not above {args.min_accuracy}")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, epilog="Other options go to every trainer: see demo.trainer -h.")
    p.add_argument("--world", type=int, default=4, help="daemons and trainers to start")
    p.add_argument("--min-accuracy", type=float, default=0.85)
    p.add_argument("--deadline", type=float, default=150.0,
                   help="seconds before unfinished trainers are stopped and the demo fails")
    p.add_argument("--workdir", help="keep the daemons' sockets and logs here (default: a "
                   "temporary directory, removed at the end)")
    p.add_argument("--log-level", default="INFO", help="the daemons' log level")
    args, extra = p.parse_known_args(argv)
    try:
        return run(args, extra)
    except KeyboardInterrupt:
        print("interrupted; trainers and daemons stopped", file=sys.stderr)
        return 130
    except LaunchError as exc:
        print(f"could not start the daemons: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
