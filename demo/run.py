"""`make demo`: Moshpit SGD with churn on 127.0.0.1: 4 daemons and 4 trainers, one trainer
killed, a 5th daemon and trainer joining.

Each trainer trains an MLP on its shard of sklearn's digits with moshpit.Optimizer (Adam,
averaged every few steps with its peers, optimizer state included). The last rank SIGKILLs
itself at a third of training; once rank 0 is half-way, a fresh trainer joins on a new daemon,
downloads the swarm's state from its peers and trains on the dead rank's shard to the end.

With --per-host N, each daemon stands for a host with N trainers (torchrun's
LOCAL_WORLD_SIZE): they train replicas of the model on their own shards, and their daemon
averages their mean with the other hosts as one peer (local_world=N). Nobody leaves or joins.

Trainers are separate processes started with subprocess (never forked); their output is streamed
here with a rank prefix. Everything started is stopped on the way out, also on Ctrl-C or at the
deadline: trainers, then daemons, in a finally block.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from demo.data import save_split
from moshpitd.launcher import LaunchError, LocalSwarm, start_daemon, wait_ready

ROOT = Path(__file__).resolve().parent.parent
STEP = re.compile(r"step (\d+)/(\d+)")
EPOCH = re.compile(r"epoch (\d+)/\d+ .*held-out accuracy ([0-9.]+)")
FINAL = re.compile(r"final accuracy ([0-9.]+)")
HOST = re.compile(r"host \d+: \d+ rounds under 'demo' as one peer, group sizes \[([0-9, ]*)\]")
_print_lock = threading.Lock()


def say(line: str) -> None:
    """Print a whole line: reader threads print concurrently."""
    with _print_lock:
        print(line, flush=True)


class Trainer:
    """One trainer process, and what its output said so far (read by a thread)."""

    def __init__(self, rank: int, args: list[str], half: threading.Event | None = None,
                 stdin: int = subprocess.DEVNULL) -> None:
        self.rank, self.half = rank, half
        self.accs: dict[int, float] = {}  # epoch -> held-out accuracy
        self.final: float | None = None
        self.left_at: int | None = None  # the step it said it was leaving at
        self.joined_at: int | None = None
        self.host_groups: list[int] = []  # --per-host, a local rank 0: its host's group sizes
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "demo.trainer", "--rank", str(rank), *args], cwd=ROOT,
            env=env, stdin=stdin, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        """Copy the output line by line, prefixing lines the trainer did not prefix itself."""
        prefix = f"[rank {self.rank}] "
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            step = STEP.search(line)
            if match := EPOCH.search(line):
                self.accs[int(match.group(1))] = float(match.group(2))
            elif match := FINAL.search(line):
                self.final = float(match.group(1))
            elif match := HOST.search(line):
                self.host_groups = [int(n) for n in match.group(1).split(",") if n.strip()]
            elif step and "leaving:" in line:
                self.left_at = int(step.group(1))
            elif step and "joined:" in line:
                self.joined_at = int(step.group(1))
            if self.half is not None and step and 2 * int(step.group(1)) >= int(step.group(2)):
                self.half.set()
            say(line if line.startswith(prefix) else prefix + line)


def stop_trainers(trainers: list[Trainer], grace: float = 5.0) -> None:
    for t in trainers:
        if t.proc.poll() is None:
            t.proc.terminate()
    deadline = time.monotonic() + grace
    for t in trainers:
        try:
            t.proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            t.proc.kill()
            t.proc.wait()


def wait_until(event: threading.Event, watched: Trainer, deadline: float) -> bool:
    """Whether `event` is set before the deadline and while `watched` still runs."""
    while not event.wait(0.1):
        if watched.proc.poll() is not None or time.monotonic() > deadline:
            return False
    return True


def curve(trainers: list[Trainer], epochs: int, width: int = 40) -> None:
    """Held-out accuracy per epoch and trainer, with a bar for rank 0's."""
    accs0 = trainers[0].accs.values()
    low = max(math.floor(10 * min(accs0, default=0.0) - 0.5) / 10, 0.0)  # the bar's zero
    print("held-out accuracy after each epoch ('-': not running then):")
    print("epoch " + "".join(f" rank {t.rank}" for t in trainers) + f"  rank 0, {low:.1f} to 1")
    for e in range(1, epochs + 1):
        cells = "".join(f"{t.accs[e]:>7.3f}" if e in t.accs else f"{'-':>7}" for t in trainers)
        bar = "#" * round(width * max(trainers[0].accs.get(e, low) - low, 0) / (1 - low))
        print(f"{e:>5} {cells}  {bar}")


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Hold a Ctrl-C back until the block is done, then raise it.

    LocalSwarm.start waits for the daemons it started without waiting before it records them,
    so a KeyboardInterrupt in between would leave those running (in their own sessions)."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    caught: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if caught:
        raise KeyboardInterrupt


def churn(swarm: LocalSwarm, trainers: list[Trainer], args: argparse.Namespace,
          extra: list[str], deadline: float) -> None:
    """Start the trainers, the joiner's daemon at half-time, and wait for them all."""
    leaver, world = args.world - 1, args.world
    data = swarm.workdir / "digits.npz"  # split once here: trainers skip importing sklearn
    save_split(data)
    common = ["--world", str(world), "--data", str(data), "--epochs", str(args.epochs), *extra]
    half = threading.Event()
    for rank, socket in enumerate(swarm.sockets):
        leave = ["--leave-at", str(1 / 3)] if rank == leaver else []
        trainers.append(Trainer(rank, ["--socket", socket, *common, *leave],
                                half if rank == 0 else None))
    # The joiner's process starts now, so that importing torch on a busy machine does not
    # delay its joining; it waits, with fresh weights, for its daemon's socket on stdin.
    joiner = Trainer(world, ["--socket", "-", "--shard", str(leaver), "--join", *common],
                     stdin=subprocess.PIPE)
    trainers.append(joiner)
    go = ""
    if wait_until(half, trainers[0], deadline):
        say(f"rank 0 is half-way: starting a new daemon for rank {world}, a fresh trainer "
            f"taking over rank {leaver}'s shard")
        daemon = start_daemon("joiner", swarm.workdir, [swarm.daemons[0].dht], args.log_level,
                              wait=False)
        swarm.daemons.append(daemon)  # stopped with the others whatever happens
        wait_ready(daemon)
        go = daemon.socket
    else:
        say("rank 0 never got half-way: no trainer joins")
    assert joiner.proc.stdin is not None
    with contextlib.suppress(BrokenPipeError):  # it died already: reported at the end
        joiner.proc.stdin.write(go + "\n")
        joiner.proc.stdin.close()
    wait_for(trainers, deadline, args.deadline)


def wait_for(trainers: list[Trainer], deadline: float, budget: float) -> None:
    """Until every trainer exits or the deadline passes (the caller then stops them)."""
    for t in trainers:
        try:
            t.proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            say(f"trainers still running after {budget:.0f} s: stopping them")
            return


def per_host(swarm: LocalSwarm, trainers: list[Trainer], args: argparse.Namespace,
             extra: list[str], deadline: float) -> None:
    """Start per_host trainers on each daemon, each on a shard of its own, and wait for them."""
    data = swarm.workdir / "digits.npz"
    save_split(data)
    world = args.world * args.per_host
    common = ["--world", str(world), "--data", str(data), "--epochs", str(args.epochs),
              "--local-world", str(args.per_host), *extra]
    for rank in range(world):
        trainers.append(Trainer(rank, ["--socket", swarm.sockets[rank // args.per_host],
                                       *common]))
    wait_for(trainers, deadline, args.deadline)


def run(args: argparse.Namespace, extra: list[str]) -> int:
    started = time.monotonic()
    swarm = LocalSwarm(args.world, args.workdir, args.log_level)
    trainers: list[Trainer] = []
    try:
        with deferred_interrupt():
            swarm.start()
        say(f"started {args.world} daemons in {time.monotonic() - started:.1f} s")
        if args.per_host:
            per_host(swarm, trainers, args, extra, started + args.deadline)
        else:
            churn(swarm, trainers, args, extra, started + args.deadline)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not stop this
        stop_trainers(trainers)
        for t in trainers:
            t.reader.join(5.0)
        for d in swarm.daemons:
            if not d.alive():
                print(f"daemon {d.name} died (exit {d.proc.returncode}):\n{d.log_tail()}")
        swarm.stop()
    print(f"finished in {time.monotonic() - started:.1f} s")
    if args.per_host:
        return report_hosts(trainers, args)
    return report(trainers, args.world - 1, args)


def report(trainers: list[Trainer], leaver: int, args: argparse.Namespace) -> int:
    """The curve, every trainer's outcome; 0 if all went as planned and accuracy is high."""
    curve(trainers, args.epochs)
    failed, finals = False, []
    for t in trainers:
        code = t.proc.returncode
        if t.rank == leaver:
            ok = code == -signal.SIGKILL and t.left_at is not None
            print(f"trainer {t.rank}: exit {code}, "
                  + (f"killed at step {t.left_at} as planned" if ok else "NOT killed as planned"))
        else:
            ok = code == 0 and t.final is not None
            joined = f"joined at step {t.joined_at}, " if t.joined_at is not None else ""
            acc = "missing" if t.final is None else f"{t.final:.4f}"
            print(f"trainer {t.rank}: exit {code}, {joined}final held-out accuracy {acc}")
            if t.final is not None:
                finals.append(t.final)
        failed |= not ok
    if failed:
        print("FAILED: not every trainer left, joined or finished as planned")
        return 1
    mean = sum(finals) / len(finals)
    print(f"mean final held-out accuracy of the {len(finals)} trainers at the end: {mean:.4f}")
    if mean <= args.min_accuracy:
        print(f"FAILED: mean accuracy is not above {args.min_accuracy}")
        return 1
    return 0


def report_hosts(trainers: list[Trainer], args: argparse.Namespace) -> int:
    """--per-host: every trainer finished with one model, and every host averaged as one
    peer (groups of at most --world, never one member per trainer), as its local rank 0 read
    from its daemon."""
    curve(trainers, args.epochs)
    failed = False
    for t in trainers:
        acc = "missing" if t.final is None else f"{t.final:.4f}"
        print(f"trainer {t.rank} (host {t.rank // args.per_host}): exit {t.proc.returncode}, "
              f"final held-out accuracy {acc}")
        failed |= t.proc.returncode != 0 or t.final is None
    for host in range(args.world):
        sizes = trainers[host * args.per_host].host_groups
        failed |= not sizes or max(sizes) > args.world
    if failed:
        print("FAILED: not every trainer finished, or a host did not average as one peer")
        return 1
    finals = [t.final for t in trainers if t.final is not None]
    mean = sum(finals) / len(finals)
    print(f"mean final held-out accuracy of the {len(finals)} trainers at the end: {mean:.4f}")
    if mean <= args.min_accuracy:
        print(f"FAILED: mean accuracy is not above {args.min_accuracy}")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Other options go to every trainer: see python -m demo.trainer -h.")
    p.add_argument("--world", type=int, help="daemons and trainers to start with (>= 3); "
                   "one more of each joins. With --per-host: daemons (hosts, >= 2). Default 4, "
                   "or 2 with --per-host")
    p.add_argument("--per-host", type=int, default=0, metavar="N",
                   help="N trainers per daemon, averaging as one peer (local_world=N); "
                   "nobody leaves or joins")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--min-accuracy", type=float, default=0.85)
    p.add_argument("--deadline", type=float, default=150.0,
                   help="seconds before unfinished trainers are stopped and the demo fails")
    p.add_argument("--workdir", help="keep the daemons' sockets and logs here (default: a "
                   "temporary directory, removed at the end)")
    p.add_argument("--log-level", default="INFO", help="the daemons' log level")
    args, extra = p.parse_known_args(argv)
    if args.per_host < 0:
        p.error("--per-host must be at least 1")
    if args.world is None:
        args.world = 2 if args.per_host else 4
    if args.per_host and args.world < 2:
        p.error("--world must be at least 2 with --per-host: hosts average with each other")
    if not args.per_host and args.world < 3:  # with 2, one would wait out every round alone
        p.error("--world must be at least 3: one trainer leaves, the others go on averaging")
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
