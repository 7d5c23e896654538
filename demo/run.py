"""`make demo`: Moshpit SGD with churn on 127.0.0.1: 4 daemons and 4 trainers of a byte-level
transformer on the Python documentation, one trainer killed, a 5th daemon and trainer joining.

Each trainer trains the results benchmark's model (bench.swarm.workload) on its own random
windows of the text with moshpit.Optimizer (AdamW, averaged every few steps with its peers,
optimizer state included) and prints its validation loss, in nats per byte, as it goes. The
last rank SIGKILLs itself at a third of training; once rank 0 is half-way, a fresh trainer joins
on a new daemon, downloads the swarm's state from its peers and trains on the dead rank's
stream to the end. At the end, a PNG of every trainer's validation loss against time.

The text is python3-doc's (bench.swarm.corpus); without that package, the pydoc topics that
ship with Python.

With --per-host N, each daemon stands for a host with N trainers (torchrun's
LOCAL_WORLD_SIZE): they train replicas of the model on their own streams, and their daemon
averages their mean with the other hosts as one peer (local_world=N). Nobody leaves or joins.

Trainers are separate processes started with subprocess (never forked); their output is streamed
here with a rank prefix. Everything started is stopped on the way out, also on Ctrl-C or at the
deadline: trainers, then daemons, in a finally block.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.swarm.corpus import load_corpus, unigram_entropy
from demo.corpus import DemoText, choose_text, trainer_env
from demo.plot import Event, Mark, plot_validation
from moshpitd.launcher import LaunchError, LocalSwarm, start_daemon, wait_ready

ROOT = Path(__file__).resolve().parent.parent
STEP = re.compile(r"step (\d+)/(\d+)")
VALIDATION = re.compile(r"step (\d+)/\d+: (?:train loss [0-9.]+, )?validation loss ([0-9.]+)$")
FINAL = re.compile(r"final validation loss ([0-9.]+)")
JOINED = re.compile(r"joined: validation loss ([0-9.]+) with its own fresh weights, ([0-9.]+) "
                    r"with the state downloaded from peers; resuming at step (\d+)/")
HOST = re.compile(r"host \d+: \d+ rounds under 'demo' as one peer, group sizes \[([0-9, ]*)\]")
_print_lock = threading.Lock()


def say(line: str) -> None:
    """Print a whole line: reader threads print concurrently."""
    with _print_lock:
        print(line, flush=True)


@dataclass(frozen=True)
class Left:
    seconds: float  # since the demo started
    step: int


@dataclass(frozen=True)
class Joined:
    seconds: float
    step: int  # the one it resumed at, downloaded with the state
    fresh: float  # validation loss with its own fresh weights
    downloaded: float  # with the state downloaded from peers


class Trainer:
    """One trainer process, and what its output said so far (read by a thread)."""

    def __init__(self, rank: int, args: list[str], started: float, env: dict[str, str],
                 half: threading.Event | None = None, stdin: int = subprocess.DEVNULL) -> None:
        self.rank, self.half, self.started = rank, half, started
        self.curve: list[tuple[float, int, float]] = []  # (seconds, step, validation loss)
        self.final: float | None = None
        self.left: Left | None = None
        self.joined: Joined | None = None
        self.host_groups: list[int] = []  # --per-host, a local rank 0: its host's group sizes
        env = {**os.environ, **env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        # niced: on a machine with fewer cores than trainers a step may wait, but the daemons'
        # rounds (and with them every trainer) should not
        self.proc = subprocess.Popen(
            ["nice", "-n", "10", sys.executable, "-m", "demo.trainer", "--rank", str(rank),
             *args], cwd=ROOT,
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
            now = time.monotonic() - self.started
            step = STEP.search(line)
            if match := VALIDATION.search(line):
                self.curve.append((now, int(match.group(1)), float(match.group(2))))
            elif match := FINAL.search(line):
                self.final = float(match.group(1))
            elif match := JOINED.search(line):  # the downloaded state's loss starts its curve
                self.joined = Joined(now, int(match.group(3)), float(match.group(1)),
                                     float(match.group(2)))
                self.curve.append((now, self.joined.step, self.joined.downloaded))
            elif match := HOST.search(line):
                self.host_groups = [int(n) for n in match.group(1).split(",") if n.strip()]
            elif step and "leaving:" in line:
                self.left = Left(now, int(step.group(1)))
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
          common: list[str], env: dict[str, str], started: float) -> None:
    """Start the trainers, the joiner's daemon once rank 0 is half-way, and wait for them."""
    leaver, world = args.world - 1, args.world
    deadline = started + args.deadline
    half = threading.Event()
    for rank, socket in enumerate(swarm.sockets):
        leave = ["--leave-at", str(1 / 3)] if rank == leaver else []
        trainers.append(Trainer(rank, ["--socket", socket, *common, *leave], started, env,
                                half if rank == 0 else None))
    # The joiner's process starts now, so that importing torch on a busy machine does not
    # delay its joining; it waits, with fresh weights, for a line on stdin: its daemon is up.
    joining = swarm.workdir / "joiner.sock"  # where start_daemon("joiner") puts the socket
    joiner = Trainer(world, ["--socket", str(joining), "--shard", str(leaver), "--join",
                             *common], started, env, stdin=subprocess.PIPE)
    trainers.append(joiner)
    go = ""
    if wait_until(half, trainers[0], deadline):
        say(f"rank 0 is half-way: starting a new daemon for rank {world}, a fresh trainer "
            f"taking over rank {leaver}'s stream")
        daemon = start_daemon("joiner", swarm.workdir, [swarm.daemons[0].dht], args.log_level,
                              wait=False)
        swarm.daemons.append(daemon)  # stopped with the others whatever happens
        wait_ready(daemon)
        go = "go"
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
             common: list[str], env: dict[str, str], started: float) -> None:
    """Start per_host trainers on each daemon, each on a stream of its own, and wait."""
    world = args.world * args.per_host
    for rank in range(world):
        trainers.append(Trainer(rank, ["--socket", swarm.sockets[rank // args.per_host],
                                       "--world", str(world), "--local-world",
                                       str(args.per_host), *common], started, env))
    wait_for(trainers, started + args.deadline, args.deadline)


def run(args: argparse.Namespace, extra: list[str]) -> int:
    started = time.monotonic()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="moshpit-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    say(f"workdir {workdir} (the daemons' sockets and logs)")
    text = choose_text(workdir, args.pydoc_topics)
    if text.missing:
        say(text.missing)
    corpus = load_corpus(text.root)
    entropy = unigram_entropy(corpus.train)
    say(f"text: {text.name}: {len(corpus.train):,} training bytes, {len(corpus.validation):,} "
        f"held out; byte unigram entropy {entropy:.3f} nats")
    swarm = LocalSwarm(args.world, workdir, args.log_level)
    trainers: list[Trainer] = []
    common = ["--steps", str(args.steps), *extra]
    try:
        with deferred_interrupt():
            swarm.start()
        say(f"started {args.world} daemons in {time.monotonic() - started:.1f} s")
        if args.per_host:
            per_host(swarm, trainers, args, common, trainer_env(text), started)
        else:
            churn(swarm, trainers, args, ["--world", str(args.world), *common],
                  trainer_env(text), started)
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
    plot = draw(trainers, args, text, entropy,
                Path(args.plot or workdir / "validation.png").resolve())
    summarize(trainers, args, entropy)
    print(f"plot of the validation loss against time: {plot}")
    if args.per_host:
        return report_hosts(trainers, args)
    return report(trainers, args.world - 1, args)


def draw(trainers: list[Trainer], args: argparse.Namespace, text: DemoText, entropy: float,
         path: Path) -> Path:
    events, marks = [], []
    for t in trainers:
        if t.left is not None:
            events.append(Event(t.left.seconds, f"rank {t.rank} killed"))
        if t.joined is not None:
            events.append(Event(t.joined.seconds, f"rank {t.rank} joins"))
            marks.append(Mark(t.joined.seconds, t.joined.fresh,
                              f"rank {t.rank}'s own fresh weights"))
    curves = {f"rank {t.rank}": [(s, loss) for s, _, loss in t.curve] for t in trainers}
    hosts = f"{args.world} hosts of {args.per_host} trainers" if args.per_host else \
        f"{args.world} trainers, one killed, one joining"
    return plot_validation(path, curves, events, marks, entropy, args.target,
                           f"Moshpit SGD on 127.0.0.1, {hosts}: {text.root}")


def summarize(trainers: list[Trainer], args: argparse.Namespace, entropy: float) -> None:
    """When the validation loss (any trainer's) first fell below the target, and the start."""
    points = sorted((s, loss, t.rank, step) for t in trainers for s, step, loss in t.curve)
    if not points:
        print("no validation loss reported")
        return
    first = next((p for p in points if p[1] < args.target), None)
    reached = "never" if first is None else \
        f"after {first[0]:.1f} s (rank {first[2]} at step {first[3]})"
    print(f"validation loss, nats per byte (byte unigram entropy {entropy:.3f}): "
          f"{points[0][1]:.3f} at the start, below {args.target:g} {reached}")


def report(trainers: list[Trainer], leaver: int, args: argparse.Namespace) -> int:
    """Every trainer's outcome; 0 if all went as planned and the loss is below the target."""
    failed, finals = False, []
    for t in trainers:
        code = t.proc.returncode
        if t.rank == leaver:
            ok = code == -signal.SIGKILL and t.left is not None
            print(f"trainer {t.rank}: exit {code}, " + (
                f"killed at step {t.left.step} as planned" if ok and t.left is not None
                else "NOT killed as planned"))
        else:
            ok = code == 0 and t.final is not None
            joined = "" if t.joined is None else (
                f"joined at step {t.joined.step} (validation loss {t.joined.fresh:.3f} with "
                f"fresh weights, {t.joined.downloaded:.3f} with the downloaded state), ")
            loss = "missing" if t.final is None else f"{t.final:.4f}"
            print(f"trainer {t.rank}: exit {code}, {joined}final validation loss {loss}")
            if t.final is not None:
                finals.append(t.final)
        failed |= not ok
    if failed:
        print("FAILED: not every trainer left, joined or finished as planned")
        return 1
    return check_final(finals, args)


def report_hosts(trainers: list[Trainer], args: argparse.Namespace) -> int:
    """--per-host: every trainer finished with one model, and every host averaged as one
    peer (groups of at most --world, never one member per trainer), as its local rank 0 read
    from its daemon."""
    failed = False
    for t in trainers:
        loss = "missing" if t.final is None else f"{t.final:.4f}"
        print(f"trainer {t.rank} (host {t.rank // args.per_host}): exit {t.proc.returncode}, "
              f"final validation loss {loss}")
        failed |= t.proc.returncode != 0 or t.final is None
    for host in range(args.world):
        sizes = trainers[host * args.per_host].host_groups
        failed |= not sizes or max(sizes) > args.world
    if failed:
        print("FAILED: not every trainer finished, or a host did not average as one peer")
        return 1
    return check_final([t.final for t in trainers if t.final is not None], args)


def check_final(finals: list[float], args: argparse.Namespace) -> int:
    mean = sum(finals) / len(finals)
    print(f"mean final validation loss of the {len(finals)} trainers at the end: {mean:.4f} "
          "nats per byte")
    if mean >= args.target:
        print(f"FAILED: the final validation loss is not below {args.target:g}")
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
    p.add_argument("--steps", type=int, default=500, help="local steps of each trainer")
    p.add_argument("--target", type=float, default=2.8,
                   help="the final validation loss (nats per byte) must be below this")
    p.add_argument("--plot", help="where to write the PNG (default: validation.png in the "
                   "workdir)")
    p.add_argument("--pydoc-topics", action="store_true",
                   help="train on Python's pydoc topics even where python3-doc is installed")
    p.add_argument("--deadline", type=float, default=300.0,
                   help="seconds before unfinished trainers are stopped and the demo fails")
    p.add_argument("--workdir", help="keep the daemons' sockets and logs here (default: a new "
                   "directory under the system's temporary one, kept after the end)")
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
    if importlib.util.find_spec("matplotlib") is None:  # before training, not after it
        print("the demo draws its plot with matplotlib: pip install -e '.[demo]'",
              file=sys.stderr)
        return 1
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
