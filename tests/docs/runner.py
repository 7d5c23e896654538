"""Run one documented example the way a reader would: in a checkout, against real daemons.

Each example runs in a fresh directory that links every top-level entry of the repository
(so `deploy/moshpitd.toml` and `python -m bench...` resolve as in a checkout, and whatever the
example writes lands there), with the interpreter's directory first on PATH (`python`,
`moshpitd`, `moshpit` are this environment's) and `MOSHPIT_SOCKET` naming its daemon.
A python example runs as `python example.py` would, in a process forked from one that already
imported torch and moshpit (see `trainer_context`).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.context
import os
import re
import runpy
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moshpit import Client
from moshpitd.launcher import LocalSwarm
from tests.docs.blocks import ROOT, Block, Substitutions, shell_script

TIMEOUT = 120.0  # s for one example (a trainer example runs a few rounds; the sim ~2 s)
STOP_TIMEOUT = 30.0  # s for an `until` example to exit after SIGINT (drain_timeout is 10 s)
FIXED_PORTS = (7700, 7701, 7702)


class ExampleFailed(AssertionError):
    pass


@dataclass
class Outcome:
    returncode: int
    output: str


def checkout(workdir: Path) -> Path:
    """A directory that looks like the repository's root to an example."""
    workdir.mkdir(parents=True, exist_ok=True)
    for entry in ROOT.iterdir():
        if entry.name not in (".git", ".venv") and not (workdir / entry.name).exists():
            (workdir / entry.name).symlink_to(entry)
    return workdir


def environment(socket_path: str, workdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOSHPITD_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["MOSHPIT_SOCKET"] = socket_path
    env["TMPDIR"] = str(workdir)  # what an example's tools put in /tmp lands in its directory
    env["PYTHONUNBUFFERED"] = "1"
    return env


def free_ports(count: int) -> list[int]:
    """Ports free on every address now (bound to the wildcard, then released)."""
    socks, ports = [], []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("0.0.0.0", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def processes_naming(path: Path) -> list[int]:
    """Live processes whose command line mentions `path`: what an example left running."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(path) in cmd:
            found.append(int(entry.name))
    return found


def kill_leftovers(workdir: Path) -> list[int]:
    pids = processes_naming(workdir)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def _fail(block: Block, what: str, output: str) -> ExampleFailed:
    return ExampleFailed(f"{block.where}: {what}\n--- example ---\n{block.code}"
                         f"--- output ---\n{output[-6000:]}")


# --- python ------------------------------------------------------------------------------------
def daemons_for(block: Block, swarm: LocalSwarm) -> list[int]:
    """Trainer i of N uses daemon i (i // K with per-host=K); a lone trainer the last daemon,
    so that one joining a run an earlier example started downloads from other daemons."""
    n = block.trainers
    return [i // block.per_host for i in range(n)] if n > 1 else [len(swarm.daemons) - 1]


def trainer_env(block: Block, trainer: int, socket: str, workdir: Path) -> dict[str, str]:
    """A trainer's environment; with per-host=K, torchrun's local rank and world as well."""
    env = environment(socket, workdir)
    if block.per_host > 1:
        env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"] = str(trainer % block.per_host), \
            str(block.per_host)
    return env


def averaged_rounds(sock: str, since: float) -> list[dict[str, Any]]:
    with Client(sock) as client:
        return [r for r in client.rounds() if r["finished"] >= since and r["result"] == "ok"
                and r["group_size"] >= 2]


_FORKS: multiprocessing.context.ForkServerContext | None = None


def trainer_context() -> multiprocessing.context.ForkServerContext:
    """Trainers fork from a server that imported torch and moshpit once: a fresh interpreter
    would spend seconds of CPU on that import per trainer, before the example's first line
    (torch._dynamo too, which the first torch optimizer imports)."""
    global _FORKS
    if _FORKS is None:
        _FORKS = multiprocessing.get_context("forkserver")
        _FORKS.set_forkserver_preload(["torch", "torch._dynamo", "moshpit"])
    return _FORKS


def trainer_main(script: str, cwd: str, env: dict[str, str], log: str) -> None:
    """A trainer process: the example as `python script.py` in `cwd` would run it."""
    os.setsid()  # its own process group, as a separate program's (and killable as one)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [script]
    sys.path.insert(0, cwd)
    runpy.run_path(script, run_name="__main__")


def run_python(block: Block, swarm: LocalSwarm, workdir: Path) -> list[Outcome]:
    """Run the example as N trainer processes at once; each must exit 0, and with N > 1 each
    of their daemons must have averaged with a peer meanwhile."""
    checkout(workdir)
    script = workdir / f"example_{block.line}.py"
    script.write_text(block.code)
    indices = daemons_for(block, swarm)
    context = trainer_context()
    started = time.time()
    procs = []
    for n, i in enumerate(indices):
        log = workdir / f"trainer{n}.log"
        proc = context.Process(target=trainer_main, args=(
            str(script), str(workdir), trainer_env(block, n, swarm.daemons[i].socket, workdir),
            str(log)))
        proc.start()
        procs.append((log, proc))
    outcomes = []
    deadline = time.monotonic() + TIMEOUT
    try:
        for log, proc in procs:
            proc.join(max(deadline - time.monotonic(), 0.1))
            code = -1 if proc.exitcode is None else proc.exitcode
            output = log.read_text(errors="replace") if log.exists() else ""
            outcomes.append(Outcome(code, output))
    finally:
        for _, proc in procs:
            if proc.exitcode is None:
                proc.kill()
                proc.join()
    for n, outcome in enumerate(outcomes):
        if outcome.returncode != 0:
            raise _fail(block, f"trainer {n} of {len(outcomes)} exited with "
                        f"{outcome.returncode} (-1: still running after {TIMEOUT:.0f} s)",
                        outcome.output)
    if block.same_output and len({o.output for o in outcomes}) > 1:
        raise _fail(block, "the trainers printed different things",
                    "\n".join(f"trainer {n}: {o.output}" for n, o in enumerate(outcomes)))
    if len(indices) > 1:
        for i in sorted(set(indices)):
            if not averaged_rounds(swarm.daemons[i].socket, started):
                raise _fail(block, f"daemon d{i} recorded no round that averaged with a peer "
                            f"while the example ran", "\n\n".join(o.output for o in outcomes))
    return outcomes


# --- shell -------------------------------------------------------------------------------------
def substitutions(block: Block, swarm: LocalSwarm, workdir: Path) -> Substitutions:
    daemon = swarm.daemons[0]
    run_dir, etc_dir = workdir / "run", workdir / "etc"
    run_dir.mkdir(parents=True, exist_ok=True)
    etc_dir.mkdir(parents=True, exist_ok=True)
    return Substitutions(daemon.socket, daemon.info["metrics"], run_dir, etc_dir,
                         dict(zip(FIXED_PORTS, free_ports(len(FIXED_PORTS)), strict=True)),
                         own_daemon=block.until is not None)


@contextlib.contextmanager
def _shell(block: Block, swarm: LocalSwarm, workdir: Path) -> Iterator[
        tuple[subprocess.Popen[bytes], Path]]:
    checkout(workdir)
    subs = substitutions(block, swarm, workdir)
    script = workdir / f"example_{block.line}.sh"
    script.write_text("set -euo pipefail\n" + subs.apply(shell_script(block)))
    env = environment(swarm.daemons[0].socket, workdir)
    # a daemon an example starts gets a free metrics port, not the fixed default 9464
    env["MOSHPITD_METRICS_LISTEN"] = "127.0.0.1:0"
    log = workdir / "output.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(["bash", str(script)], cwd=workdir, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True, preexec_fn=_default_sigint)
    try:
        yield proc, log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        kill_leftovers(workdir)


def run_shell(block: Block, swarm: LocalSwarm, workdir: Path) -> Outcome:
    with _shell(block, swarm, workdir) as (proc, log):
        try:
            code = proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            code = -1
        output = log.read_text(errors="replace")
    if code != 0:
        raise _fail(block, f"exited with {code} (-1: still running after {TIMEOUT:.0f} s)",
                    output)
    left = processes_naming(workdir)
    if left:
        raise _fail(block, f"left processes running: {left}", output)
    return Outcome(code, output)


def _default_sigint() -> None:
    """In the example's shell, before exec: SIGINT at its default. A suite run from a
    background job starts with SIGINT ignored, which the shell and every child would inherit
    (and a non-interactive shell cannot trap an ignored signal), so Ctrl-C would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_until(block: Block, swarm: LocalSwarm, workdir: Path) -> Outcome:
    """A block that runs until Ctrl-C: wait for its output to say it is up, then SIGINT it;
    it must exit 0 and leave nothing running."""
    assert block.until is not None
    ready = re.compile(block.until)
    with _shell(block, swarm, workdir) as (proc, log):
        deadline = time.monotonic() + TIMEOUT
        output = ""
        while time.monotonic() < deadline:
            output = log.read_text(errors="replace")
            if ready.search(output) or proc.poll() is not None:
                break
            time.sleep(0.05)
        if not ready.search(output):
            code = proc.poll()
            raise _fail(block, f"output never matched {block.until!r} "
                        f"({'exited with ' + str(code) if code is not None else 'timed out'})",
                        output)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            code = proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            code = -1
        output = log.read_text(errors="replace")
        if code != 0:
            raise _fail(block, f"exited with {code} after SIGINT (-1: still running "
                        f"{STOP_TIMEOUT:.0f} s later)", output)
        left = processes_naming(workdir)
    if left:
        raise _fail(block, f"left processes running after SIGINT: {left}", output)
    return Outcome(code, output)


def run(block: Block, swarm: LocalSwarm, workdir: Path) -> list[Outcome]:
    if block.lang == "python":
        return run_python(block, swarm, workdir)
    if block.until is not None:
        return [run_until(block, swarm, workdir)]
    return [run_shell(block, swarm, workdir)]
