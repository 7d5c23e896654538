"""`python -m bench.training`: time to a held-out accuracy, Moshpit SGD vs torch DDP (gloo).

P processes per system on this machine, in one invocation, each training the demo MLP on its
shard of sklearn's digits with the same optimizer (Adam), learning rate, batch and epochs:

- DDP: DistributedDataParallel over gloo, gradients all-reduced in every step; rank 0 evaluates.
- Moshpit SGD: one moshpitd per process (LocalSwarm), moshpit.Optimizer averaging parameters
  every --average-every local steps (weighted by samples), group_size = P. Time to target is
  when the slowest surviving worker first reaches the target (each evaluates its own model).

Each system runs twice: undisturbed, then with rank P-1 SIGKILLing itself after half the
epochs. Times count from the moment every process is ready and told to go (process start,
imports and connection set-up excluded) to the end of the epoch whose evaluation first reached
the target; accuracy is checked once per epoch.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import queue
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.cli import exit_on_sigterm, positive
from bench.procs import BenchError, Child, Children, child_env
from bench.runners import free_port

TERMINAL = frozenset({"done", "error", "exit"})


def _log(msg: str) -> None:
    print(f"[bench.training] {msg}", file=sys.stderr, flush=True)


@dataclass
class Run:
    """What one system did in one scenario; times in seconds since `go`."""

    system: str
    scenario: str
    time_to_target: float | None = None
    final_accuracy: float | None = None  # ddp: rank 0; moshpit: the worst surviving worker
    epochs: int = 0  # completed by every surviving process
    continued: bool = True  # False: the survivors could not train on
    failure: str | None = None  # ddp: the error the survivors got, and when
    killed_at: float | None = None
    train_seconds: float | None = None  # go -> last process done (or failed)
    startup_seconds: float = 0.0  # process start -> every process ready
    accuracy_by_epoch: dict[str, list[float | None]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def _pump(child: Child, rank: int, out: queue.Queue[dict[str, Any]]) -> None:
    """Forwards a child's events, then one "exit" event when its stdout ends."""
    while True:
        try:
            event = child.recv(timeout=1e6)
        except BenchError as exc:
            out.put({"event": "exit", "rank": rank, "t": time.monotonic(), "message": str(exc)})
            return
        out.put({**event, "rank": rank})


def _drive(kids: list[Child], deadline: float, run: Run,
           on_kill: Callable[[int], None] | None = None,
           ) -> tuple[float, dict[int, list[dict[str, Any]]]]:
    """Waits until all are ready, says go, and collects events until every child is finished.

    Returns the go time and every rank's events in order."""
    started = time.monotonic()
    for kid in kids:
        kid.recv(timeout=120.0)  # {"event": "ready"}; an early crash raises with its stderr
    run.startup_seconds = time.monotonic() - started
    events: queue.Queue[dict[str, Any]] = queue.Queue()
    for rank, kid in enumerate(kids):
        threading.Thread(target=_pump, args=(kid, rank, events), daemon=True).start()
    t0 = time.monotonic()
    for kid in kids:
        kid.send("go")
    by_rank: dict[int, list[dict[str, Any]]] = {r: [] for r in range(len(kids))}
    pending = set(by_rank)
    while pending:
        try:
            event = events.get(timeout=max(t0 + deadline - time.monotonic(), 0.01))
        except queue.Empty:
            for rank in pending:
                by_rank[rank].append({"event": "exit", "t": time.monotonic(),
                                      "message": f"still running after {deadline:.0f} s"})
            break
        if event["rank"] not in pending:  # the end of a process that already reported its end
            continue
        by_rank[event["rank"]].append(event)
        if event["event"] == "kill" and on_kill is not None:
            on_kill(event["rank"])
        if event["event"] in TERMINAL:
            pending.discard(event["rank"])
            if event["event"] == "exit" and not any(e["event"] == "kill"
                                                     for e in by_rank[event["rank"]]):
                _log(f"rank {event['rank']} exited unexpectedly: {event['message']}")
    return t0, by_rank


def _first_at(events: list[dict[str, Any]], target: float, t0: float) -> float | None:
    return next((e["t"] - t0 for e in events
                 if e["event"] == "epoch" and e["acc"] is not None and e["acc"] >= target), None)


def _epochs(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "epoch"]


def _summarize(run: Run, t0: float, by_rank: dict[int, list[dict[str, Any]]], target: float,
               evaluators: list[int]) -> None:
    """Fills `run` from the events; `evaluators` are the ranks whose accuracy counts."""
    kills = [e for evs in by_rank.values() for e in evs if e["event"] == "kill"]
    if kills:
        run.killed_at = kills[0]["t"] - t0
    killed = {r for r, evs in by_rank.items() if any(e["event"] == "kill" for e in evs)}
    survivors = [r for r in by_rank if r not in killed]
    ends = [evs[-1]["t"] for evs in by_rank.values() if evs]
    run.train_seconds = max(ends) - t0 if ends else None
    run.epochs = min((len(_epochs(by_rank[r])) for r in survivors), default=0)
    errors = [(r, e) for r in survivors for e in by_rank[r] if e["event"] in ("error", "exit")]
    if errors:
        run.continued = False
        r, e = min(errors, key=lambda re: re[1]["t"])
        after = f", {e['t'] - t0 - run.killed_at:.2f} s after the kill" if kills else ""
        # gloo's message: "[.../pair.cc:537] Read error ...: Connection reset by peer. This is
        # typically caused by ...": its first sentence, without the source location.
        message = re.split(r"(?<=\.)\s", re.sub(r"^\[[^\]]*\]\s*", "", e["message"]), maxsplit=1)[0]
        what = f"{e['kind']}: {message}" if e["event"] == "error" else message
        run.failure = (f"rank {r} at t={e['t'] - t0:.2f} s{after}, after epoch "
                       f"{len(_epochs(by_rank[r]))}: {what}")
    run.extra["failures_by_rank"] = {
        str(r): {"t": e["t"] - t0, "epochs_done": len(_epochs(by_rank[r])),
                 "kind": e.get("kind", "exit"), "message": e["message"]}
        for r, e in errors}
    # How long rank 0's epochs took, before and after the kill: what the kill cost survivors.
    times = [t0] + [e["t"] for e in _epochs(by_rank[0])]
    laps = [b - a for a, b in itertools.pairwise(times)]
    split = kills[0]["epoch"] if kills else len(laps)
    run.extra["median_epoch_seconds"] = {
        "before_kill" if kills else "all": statistics.median(laps[:split]) if laps else None,
        **({"after_kill": statistics.median(laps[split:]) if laps[split:] else None}
           if kills else {})}
    judged = [r for r in evaluators if r in survivors]
    run.accuracy_by_epoch = {str(r): [e["acc"] for e in _epochs(by_rank[r])] for r in by_rank
                             if r in evaluators}
    firsts = [_first_at(by_rank[r], target, t0) for r in judged]
    if firsts and all(f is not None for f in firsts):
        run.time_to_target = max(f for f in firsts if f is not None)
    finals = [_epochs(by_rank[r])[-1]["acc"] for r in judged if _epochs(by_rank[r])]
    run.final_accuracy = min(finals) if finals else None


def _per_round(events: list[dict[str, Any]],
               kill_epoch: int | None) -> dict[str, dict[str, float | None]]:
    """A moshpit worker's mean daemon-side seconds per round (whole round, matchmaking part),
    before and after the kill; events carry cumulative counters."""
    marks = [e for e in events if e["event"] in ("epoch", "done")]
    if not marks or (kill_epoch is not None and len(marks) < kill_epoch):
        return {}
    spans = ({"all": (None, marks[-1])} if kill_epoch is None else
             {"before_kill": (None, marks[kill_epoch - 1]),
              "after_kill": (marks[kill_epoch - 1], marks[-1])})
    out = {}
    for name, (a, b) in spans.items():
        rounds = b["rounds"] - (a["rounds"] if a else 0)
        out[name] = {k: (b[f"{k}_seconds"] - (a[f"{k}_seconds"] if a else 0.0)) / rounds
                     if rounds else None for k in ("round", "matchmaking")}
    return out


def worker_args(args: argparse.Namespace, rank: int, data: Path, kill: bool) -> list[str]:
    return ["--rank", str(rank), "--peers", str(args.peers), "--data", str(data),
            "--epochs", str(args.epochs), "--batch", str(args.batch), "--lr", str(args.lr),
            "--kill-rank", str(args.peers - 1 if kill else -1),
            "--kill-epoch", str(args.epochs // 2)]


def run_ddp(args: argparse.Namespace, data: Path, kill: bool) -> Run:
    run = Run("ddp (gloo)", "rank killed" if kill else "all alive")
    port = free_port()
    env = child_env(GLOO_SOCKET_IFNAME="lo")
    with Children() as kids:
        ranks = [kids.start(f"ddp rank {r}", "bench.ddp_worker",
                            [*worker_args(args, r, data, kill), "--port", str(port),
                             "--timeout", str(args.ddp_timeout)], env)
                 for r in range(args.peers)]
        t0, by_rank = _drive(ranks, args.deadline, run)
    _summarize(run, t0, by_rank, args.target, evaluators=[0])
    return run


def run_moshpit(args: argparse.Namespace, data: Path, swarm: Any, kill: bool) -> Run:
    run = Run("moshpit", "rank killed" if kill else "all alive")
    key = f"bench-training-{'kill' if kill else 'alive'}-{time.time_ns()}"

    def on_kill(rank: int) -> None:
        if args.kill_daemon:  # the whole machine is gone, not just the trainer
            swarm.daemons[rank].kill()

    with Children() as kids:
        workers = [kids.start(f"moshpit worker {r}", "bench.training_worker",
                              [*worker_args(args, r, data, kill), "--socket", sock,
                               "--key", key, "--average-every", str(args.average_every),
                               "--group-size", str(args.peers),
                               "--timeout", str(args.round_timeout)], child_env())
                   for r, sock in enumerate(swarm.sockets)]
        t0, by_rank = _drive(workers, args.deadline, run, on_kill)
    _summarize(run, t0, by_rank, args.target, evaluators=list(by_rank))
    survivors = [evs for evs in by_rank.values() if evs and evs[-1]["event"] == "done"]
    groups: dict[str, int] = {}
    for evs in survivors:
        for size, n in evs[-1]["groups"].items():
            groups[size] = groups.get(size, 0) + n
    run.extra.update({
        "rank0_mean_seconds_per_round": _per_round(by_rank[0], args.epochs // 2 if kill else None),
        "average_every": args.average_every,
        "rounds_per_survivor": [evs[-1]["rounds"] for evs in survivors],
        "failed_rounds_per_survivor": [evs[-1]["failed_rounds"] for evs in survivors],
        "group_sizes_seen": groups,  # summed over survivors: size -> successful rounds
        "final_accuracy_per_survivor": [evs[-1]["acc"] for evs in survivors],
    })
    return run


@contextlib.contextmanager
def _swarm(args: argparse.Namespace) -> Iterator[Any]:
    from moshpitd.launcher import LaunchError, LocalSwarm

    try:
        swarm = LocalSwarm(args.peers, log_level="WARNING").start()
    except LaunchError as exc:
        raise BenchError(f"moshpit swarm did not start: {exc}") from exc
    try:
        yield swarm
    except BenchError as exc:
        logs = "\n".join(f"--- {d.name} log tail ---\n{d.log_tail(15)}" for d in swarm.daemons)
        raise BenchError(f"{exc}\n{logs}") from exc
    finally:
        swarm.stop()


def fmt_row(r: Run, target: float) -> list[str]:
    ttt = "never" if r.time_to_target is None else f"{r.time_to_target:.2f}"
    acc = "-" if r.final_accuracy is None else f"{r.final_accuracy:.4f}"
    laps = r.extra.get("median_epoch_seconds", {})
    if not r.continued:
        failure = r.failure or ""
        note = f"CANNOT CONTINUE: {failure if len(failure) < 150 else failure[:147] + '...'}"
    elif r.killed_at is not None:
        note = f"rank killed at {r.killed_at:.2f} s; survivors trained on"
        if laps.get("after_kill") is not None:
            note += (f"; epochs took {laps['before_kill']:.2f} s before the kill, "
                     f"{laps['after_kill']:.2f} s after (medians)")
        per_round = r.extra.get("rank0_mean_seconds_per_round", {})
        if all(per_round.get(k, {}).get("round") is not None
               for k in ("before_kill", "after_kill")):
            b, a = per_round["before_kill"], per_round["after_kill"]
            note += (f"; rounds {b['round']:.3f} s -> {a['round']:.3f} s (matchmaking "
                     f"{b['matchmaking']:.3f} -> {a['matchmaking']:.3f} s)")
    else:
        note = ""
    if r.time_to_target is not None and r.killed_at is not None and (
            r.time_to_target < r.killed_at):
        note += f" (target {target} reached before the kill)"
    train = "-" if r.train_seconds is None else f"{r.train_seconds:.2f}"
    return [r.system, r.scenario, ttt, acc, str(r.epochs), train, note]


def print_table(runs: list[Run], args: argparse.Namespace) -> None:
    head = ["system", "scenario", f"to {args.target} (s)", "final acc", "epochs", "train s",
            "note"]
    cells = [head] + [fmt_row(r, args.target) for r in runs]
    widths = [max(len(row[i]) for row in cells) for i in range(len(head) - 1)]
    for i, row in enumerate(cells):
        print("  ".join(c.ljust(w) if j < 2 else c.rjust(w)
                        for j, (c, w) in enumerate(zip(row, widths, strict=False)))
              + "  " + row[-1])
        if i == 0:
            print("  ".join("-" * w for w in widths) + "  ----")
    print(f"\n{args.peers} processes per system, Adam lr {args.lr}, batch {args.batch} per "
          f"process, {args.epochs} epochs; moshpit averages every {args.average_every} local "
          "steps\n(group size = processes, weight = samples). Times from `go` (all processes "
          "ready) to the end of\nthe first epoch that reached the target: ddp = rank 0's model; "
          "moshpit = the slowest surviving\nworker, each evaluating its own model; final acc: "
          f"ddp rank 0, moshpit the worst survivor. Killed:\nrank {args.peers - 1} SIGKILLs "
          f"itself after epoch {args.epochs // 2}"
          + (" (and its daemon is killed)." if args.kill_daemon else
             " (its daemon stays up, idle)."))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.training", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", type=positive, default=4, help="processes per system (default 4)")
    p.add_argument("--target", type=float, default=0.95,
                   help="held-out accuracy to reach (default 0.95)")
    p.add_argument("--epochs", type=positive, default=30, help="epochs per run (default 30)")
    p.add_argument("--batch", type=positive, default=32, help="batch per process (default 32)")
    p.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate (default 0.01)")
    p.add_argument("--average-every", type=positive, default=4,
                   help="moshpit: local steps between averaging rounds (default 4)")
    p.add_argument("--round-timeout", type=float, default=10.0,
                   help="moshpit: timeout of one averaging round (default 10 s)")
    p.add_argument("--ddp-timeout", type=float, default=15.0,
                   help="ddp: init_process_group timeout, bounds a hung collective (default 15)")
    p.add_argument("--deadline", type=float, default=90.0,
                   help="seconds of training after which a run's processes are stopped "
                        "(default 90)")
    p.add_argument("--kill-daemon", action="store_true",
                   help="moshpit: also kill the killed worker's daemon (a whole machine lost)")
    p.add_argument("--json", action="store_true", help="print one JSON object, not a table")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.peers < 3:
        parser.error("--peers must be at least 3: after a kill moshpit needs a group of two")
    if args.epochs < 2:
        parser.error("--epochs must be at least 2 to kill a process halfway")
    exit_on_sigterm()
    from demo.model import save_split

    started = time.monotonic()
    runs: list[Run] = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-training-") as tmp:
            data = Path(tmp) / "digits.npz"  # split once: workers skip importing sklearn
            save_split(data)
            with np.load(data) as split:  # shards are equal: every rank runs as many steps
                steps_per_epoch = math.ceil(len(split["x_train"]) // args.peers / args.batch)
            for kill in (False, True):
                _log(f"ddp, {'rank killed' if kill else 'all alive'}")
                runs.append(run_ddp(args, data, kill))
            with _swarm(args) as swarm:
                for kill in (False, True):
                    _log(f"moshpit, {'rank killed' if kill else 'all alive'}")
                    runs.append(run_moshpit(args, data, swarm, kill))
    except BenchError as exc:
        print(f"bench.training: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench.training: interrupted; children and daemons stopped", file=sys.stderr)
        return 130
    _log(f"all runs done in {time.monotonic() - started:.1f} s")
    if args.json:
        print(json.dumps({
            "peers": args.peers, "target": args.target, "epochs": args.epochs,
            "batch": args.batch, "lr": args.lr, "optimizer": "Adam",
            "average_every": args.average_every, "kill_rank": args.peers - 1,
            "kill_after_epoch": args.epochs // 2, "kill_daemon": args.kill_daemon,
            "steps_per_epoch": steps_per_epoch,
            "runs": [asdict(r) for r in runs]}, indent=2))
    else:
        print_table(runs, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
