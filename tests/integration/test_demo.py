"""`make demo`, smaller: 3 daemons and trainers for a few epochs, one killed, one joining;
and `--per-host 2`: 2 daemons with 2 trainers each, every host averaging as one peer.

The demo runs as `make demo` runs it (`python -m demo.run`), in its own process group, with its
daemons' sockets and logs in a workdir of ours: every process it starts names that directory on
its command line (daemons their socket, trainers the data split), which is how the tests find
any left behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORLD = 3
EPOCHS = 4
ROUND = re.compile(r"^\[rank 0\] round (\d+) at step \d+/\d+: group of (\d+), [0-9.]+ s$", re.M)
EPOCH = re.compile(r"^\[rank (\d+)\] epoch (\d+)/(\d+) \(step \d+/\d+\): loss [0-9.]+, "
                   r"held-out accuracy ([0-9.]+)$", re.M)
JOINED = re.compile(r"^\[rank 3\] joined: shard loss ([0-9.]+) with its own fresh weights, "
                    r"([0-9.]+) with the state downloaded from peers", re.M)
MEAN = re.compile(r"^mean final held-out accuracy of the 3 trainers at the end: ([0-9.]+)$",
                  re.M)


def start_demo(workdir: Path, epochs: int, *extra: str, world: int = WORLD
               ) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "demo.run", "--world", str(world), "--epochs", str(epochs),
         "--workdir", str(workdir), "--deadline", "100", *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
        preexec_fn=_default_sigint)


def _default_sigint() -> None:
    """As in a terminal: a shell that runs the tests in the background (CI scripts do) starts
    them with SIGINT ignored, which every child would inherit, Ctrl-C included."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def processes_naming(path: Path) -> list[str]:
    """Command lines of the live processes that mention `path` (zombies have none)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it exited while we looked
            continue
        if str(path) in cmd:
            found.append(f"{entry.name}: {cmd}")
    return found


def kill_leftovers(path: Path) -> None:
    """After a failed assertion: leave nothing running for the next tests."""
    for line in processes_naming(path):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)


def stop_demo(demo: subprocess.Popen[str], workdir: Path) -> list[str]:
    """Whatever happened: the demo's processes that were still alive (then killed)."""
    if demo.poll() is None:
        os.killpg(demo.pid, signal.SIGKILL)
        demo.wait()
    left = processes_naming(workdir)
    kill_leftovers(workdir)
    return left


def run_demo(workdir: Path, epochs: int, *args: str, world: int = WORLD) -> str:
    """The demo run to its end: it exits 0 and leaves no process behind; its output."""
    demo = start_demo(workdir, epochs, *args, world=world)
    try:
        out, _ = demo.communicate(timeout=120)
    finally:
        left = stop_demo(demo, workdir)
    assert demo.returncode == 0, out[-4000:]
    assert not left, left
    return out


def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    out = run_demo(tmp_path / "demo", EPOCHS)
    rounds = ROUND.findall(out)
    assert len(rounds) >= 10, out[-4000:]
    assert {int(size) for _, size in rounds} <= {2, 3}, rounds
    assert "3" in {size for _, size in rounds}, rounds
    epochs: dict[int, list[int]] = {}
    for rank, epoch, total, _ in EPOCH.findall(out):
        assert int(total) == EPOCHS
        epochs.setdefault(int(rank), []).append(int(epoch))
    # the survivors report every epoch, the joiner those it was there for, the leaver at most
    # the first
    assert epochs[0] == epochs[1] == list(range(1, EPOCHS + 1)), epochs
    assert epochs.get(2, []) in ([], [1]) and epochs[3] and epochs[3][-1] == EPOCHS, epochs
    assert re.search(r"^\[rank 2\] leaving: killed at step \d+/", out, re.M), out[-4000:]
    assert re.search(r"^trainer 2: exit -9, killed at step \d+ as planned$", out, re.M)
    joined = JOINED.search(out)
    assert joined, out[-4000:]
    # the joiner starts from the swarm's state, not its own fresh weights
    assert float(joined.group(2)) < 0.5 * float(joined.group(1)), joined.group(0)
    assert re.search(r"^trainer 3: exit 0, joined at step \d+, final held-out accuracy", out,
                     re.M)
    # the last round, with everyone, leaves one model (BatchNorm buffers included) everywhere
    finals = re.findall(r"^trainer [013]: exit 0, .*final held-out accuracy ([0-9.]+)$", out,
                        re.M)
    assert len(finals) == WORLD and len(set(finals)) == 1, finals
    mean = MEAN.search(out)
    assert mean, out[-4000:]
    assert float(mean.group(1)) > 0.93, mean.group(0)  # chance is 0.1; one epoch gives ~0.9


PER_HOST_ROUND = re.compile(r"^\[rank 0\] round \d+ at step \d+/\d+: group of (\d+), "
                            r"[0-9.]+ s, local ranks \[([0-9, ]+)\]$", re.M)


def test_demo_per_host_averages_each_host_as_one_peer(tmp_path: Path) -> None:
    """--per-host 2 --world 2: 4 trainers, 2 per daemon. Every round is a group of the 2 hosts
    (4 if every trainer were its own peer), holding both local trainers' mean, and the last
    round leaves one model on all four."""
    out = run_demo(tmp_path / "per-host", 2, "--per-host", "2", world=2)
    rounds = PER_HOST_ROUND.findall(out)
    assert len(rounds) >= 5, out[-4000:]
    assert {size for size, _ in rounds} == {"2"}, rounds
    # a replica later than the local deadline is left out of a round, not of every round
    assert "0, 1" in {ranks for _, ranks in rounds}, rounds
    hosts = re.findall(r"^\[rank [02]\] host (\d): (\d+) rounds under 'demo' as one peer, "
                       r"group sizes \[2\]$", out, re.M)
    assert sorted(h for h, _ in hosts) == ["0", "1"] and all(int(n) >= 5 for _, n in hosts), hosts
    finals = re.findall(r"^trainer \d \(host [01]\): exit 0, final held-out accuracy "
                        r"([0-9.]+)$", out, re.M)
    assert len(finals) == 4 and len(set(finals)) == 1, finals  # one model on every trainer


def test_demo_ctrl_c_stops_everything(tmp_path: Path) -> None:
    """SIGINT to the demo's process group, as Ctrl-C in a terminal sends it, mid-training."""
    workdir = tmp_path / "demo"
    demo = start_demo(workdir, 12)  # more than it gets to train: it is interrupted
    assert demo.stdout is not None
    seen: list[str] = []
    try:
        for line in demo.stdout:
            seen.append(line)
            if ROUND.match(line.rstrip("\n")):
                break
        assert any(ROUND.match(s.rstrip("\n")) for s in seen), "".join(seen)[-4000:]
        running = processes_naming(workdir)
        daemons = [c for c in running if "-m moshpitd" in c]
        trainers = [c for c in running if "-m demo.trainer" in c]
        assert len(daemons) >= WORLD and len(trainers) == WORLD + 1, running
        os.killpg(demo.pid, signal.SIGINT)
        interrupted = time.monotonic()
        rest, _ = demo.communicate(timeout=30)
        took = time.monotonic() - interrupted
    finally:
        left = stop_demo(demo, workdir)
    assert demo.returncode == 130, rest[-4000:]
    assert "interrupted; trainers and daemons stopped" in rest
    assert took < 15, took
    assert not left, left
