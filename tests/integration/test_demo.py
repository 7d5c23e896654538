"""`make demo`, smaller: 3 daemons and trainers for 60 steps each, one killed, one
joining; and `--per-host 2` on the pydoc-topics text: 2 daemons with 2 trainers each, every
host averaging as one peer.

The demo runs as `make demo` runs it (`python -m demo.run`), in its own process group, with its
daemons' sockets and logs in a workdir of ours: every process it starts names that directory on
its command line (daemons and trainers their socket), which is how the tests find any left
behind.
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

import pytest

from bench.swarm import corpus as corpus_mod
from bench.swarm.corpus import load_corpus, unigram_entropy
from demo.corpus import choose_text

ROOT = Path(__file__).resolve().parents[2]
WORLD = 3
STEPS = 60
PER_HOST_STEPS = 40
# Below the byte unigram entropy of either text (3.37; 3.27 for the pydoc topics) by a margin:
# the models use context. `make demo`'s 500 steps go below 2.8; these runs stop at about 2.85.
TARGET = 3.1
ROUND = re.compile(r"^\[rank 0\] round (\d+) at step \d+/\d+: group of (\d+), [0-9.]+ s$", re.M)
VALIDATION = re.compile(r"^\[rank (\d+)\] step (\d+)/(\d+): (?:train loss [0-9.]+, )?"
                        r"validation loss ([0-9.]+)$", re.M)
JOINED = re.compile(r"^\[rank 3\] joined: validation loss ([0-9.]+) with its own fresh "
                    r"weights, ([0-9.]+) with the state downloaded from peers", re.M)
ENTROPY = re.compile(r"held out; byte unigram entropy ([0-9.]+) nats$", re.M)
BELOW = re.compile(rf"^validation loss, nats per byte \(byte unigram entropy [0-9.]+\): "
                   rf"[0-9.]+ at the start, below {TARGET} after [0-9.]+ s \(rank \d at step "
                   r"\d+\)$", re.M)
PLOT = re.compile(r"^plot of the validation loss against time: (.+)$", re.M)


def start_demo(workdir: Path, steps: int, *extra: str, world: int = WORLD
               ) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "demo.run", "--world", str(world), "--steps", str(steps),
         "--target", str(TARGET), "--workdir", str(workdir), "--deadline", "100", *extra],
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


def run_demo(workdir: Path, steps: int, *args: str, world: int = WORLD) -> str:
    """The demo run to its end: it exits 0 and leaves no process behind; its output."""
    demo = start_demo(workdir, steps, *args, world=world)
    try:
        out, _ = demo.communicate(timeout=120)
    finally:
        left = stop_demo(demo, workdir)
    assert demo.returncode == 0, out[-4000:]
    assert not left, left
    return out


def losses_by_rank(out: str, steps: int = STEPS) -> dict[int, list[tuple[int, float]]]:
    """Each rank's (step, validation loss) lines, in order; every one counts to `steps`."""
    found: dict[int, list[tuple[int, float]]] = {}
    for rank, step, total, loss in VALIDATION.findall(out):
        assert int(total) == steps
        found.setdefault(int(rank), []).append((int(step), float(loss)))
    return found


def check_learnt(out: str, ranks: list[int], steps: int = STEPS, joiner: int | None = None
                  ) -> None:
    """The loss fell from the fresh model's (about ln 256; the joiner's from its download) to
    below the unigram entropy and the target, every trainer at the end holds one model, and
    the plot of it is a PNG."""
    entropy = ENTROPY.search(out)
    assert entropy, out[-4000:]
    curves = losses_by_rank(out, steps)
    for rank in ranks:
        first, last = curves[rank][0][1], curves[rank][-1][1]
        assert last < min(first, TARGET, float(entropy.group(1))), curves[rank]
        assert first > 5.0 or rank == joiner, curves[rank]
    assert BELOW.search(out), out[-4000:]
    finals = re.findall(r"^trainer \d.*: exit 0, .*final validation loss ([0-9.]+)$", out, re.M)
    assert len(finals) == len(ranks) and len(set(finals)) == 1, finals
    assert float(finals[0]) < TARGET
    plot = PLOT.search(out)
    assert plot, out[-4000:]
    png = Path(plot.group(1)).read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000, len(png)


def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    out = run_demo(tmp_path / "demo", STEPS)
    rounds = ROUND.findall(out)
    assert len(rounds) >= 10, out[-4000:]
    assert {int(size) for _, size in rounds} <= {2, 3}, rounds
    assert "3" in {size for _, size in rounds}, rounds
    steps = {rank: [s for s, _ in points] for rank, points in losses_by_rank(out).items()}
    # the survivors report from step 0 to the end, the leaver up to a third, the joiner from
    # the step it downloaded to the end
    assert steps[0] == steps[1] == list(range(0, STEPS + 1, 20)), steps
    assert steps[2] and max(steps[2]) <= STEPS // 3, steps
    assert steps[3] and min(steps[3]) > STEPS // 3 and steps[3][-1] == STEPS, steps
    assert re.search(rf"^\[rank 2\] leaving: killed at step {STEPS // 3}/", out, re.M), \
        out[-4000:]
    assert re.search(rf"^trainer 2: exit -9, killed at step {STEPS // 3} as planned$", out,
                     re.M)
    joined, entropy = JOINED.search(out), ENTROPY.search(out)
    assert joined and entropy, out[-4000:]
    # the joiner starts from what the swarm learnt, not from its own fresh weights (ln 256)
    fresh, downloaded = float(joined.group(1)), float(joined.group(2))
    assert downloaded < float(entropy.group(1)) < 5.0 < fresh, joined.group(0)
    assert re.search(r"^trainer 3: exit 0, joined at step \d+ \(validation loss", out, re.M)
    check_learnt(out, [0, 1, 3], joiner=3)


PER_HOST_ROUND = re.compile(r"^\[rank 0\] round \d+ at step \d+/\d+: group of (\d+), "
                            r"[0-9.]+ s, local ranks \[([0-9, ]+)\]$", re.M)


def test_demo_per_host_averages_each_host_as_one_peer(tmp_path: Path) -> None:
    """--per-host 2 --world 2: 4 trainers, 2 per daemon. Every round is a group of the 2 hosts
    (4 if every trainer were its own peer), holding both local trainers' mean, and the last
    round leaves one model on all four. On the pydoc topics: the text used where python3-doc
    is missing learns as well."""
    workdir = tmp_path / "per-host"
    out = run_demo(workdir, PER_HOST_STEPS, "--per-host", "2", "--pydoc-topics",
                   "--plot", str(tmp_path / "plot.png"), world=2)
    assert re.search(r"^text: Python's pydoc topics .*, written to "
                     + re.escape(str(workdir)), out, re.M), out[:2000]
    rounds = PER_HOST_ROUND.findall(out)
    assert len(rounds) >= 5, out[-4000:]
    assert {size for size, _ in rounds} == {"2"}, rounds
    # a replica later than the local deadline is left out of a round, not of every round
    assert "0, 1" in {ranks for _, ranks in rounds}, rounds
    hosts = re.findall(r"^\[rank [02]\] host (\d): (\d+) rounds under 'demo' as one peer, "
                       r"group sizes \[2\], \d+ not averaged$", out, re.M)
    assert sorted(h for h, _ in hosts) == ["0", "1"] and all(int(n) >= 5 for _, n in hosts), \
        (hosts, out[-4000:])
    plot = PLOT.search(out)
    assert plot and plot.group(1) == str(tmp_path / "plot.png"), out[-4000:]
    check_learnt(out, [0, 1, 2, 3], PER_HOST_STEPS)


def test_demo_ctrl_c_stops_everything(tmp_path: Path) -> None:
    """SIGINT to the demo's process group, as Ctrl-C in a terminal sends it, mid-training."""
    workdir = tmp_path / "demo"
    demo = start_demo(workdir, 100 * STEPS)  # more than it gets to train: it is interrupted
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


def test_without_python3_doc_the_demo_says_how_to_install_it_and_uses_pydoc_topics(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpus_mod, "SOURCES_GLOB", str(tmp_path / "nothing*"))
    monkeypatch.delenv(corpus_mod.ENV_DIR, raising=False)
    text = choose_text(tmp_path)
    assert text.missing and "apt-get install python3-doc" in text.missing, text.missing
    assert text.root == tmp_path / "pydoc-topics"
    corpus = load_corpus(text.root)
    # English prose split by file like python3-doc's pages, with enough held out to validate
    assert len(corpus.train) > 200_000 and len(corpus.validation) > 20_000
    assert 3.0 < unigram_entropy(corpus.train) < 3.6
