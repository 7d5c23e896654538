"""Child processes that speak JSON lines over stdin/stdout.

Children are started fresh with subprocess (never forked: grpc and gloo are not fork-safe) in
their own session, so a terminal Ctrl-C reaches only the orchestrator, which then stops them all.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent


class BenchError(RuntimeError):
    """A benchmark child failed or broke the protocol."""


def child_env(**extra: str) -> dict[str, str]:
    """Our environment plus the repo on the path and one intra-op thread per child."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


class Child:
    """One child; stdout lines are queued by a thread so reads can time out."""

    def __init__(self, name: str, module: str, args: list[str], env: dict[str, str],
                 prefix: Sequence[str] = (), python: str = sys.executable) -> None:
        """`prefix` goes before the interpreter (e.g. `ip netns exec NS`)."""
        self.name = name
        self.proc = subprocess.Popen(
            [*prefix, python, "-m", module, *args], cwd=ROOT, env=env, text=True, bufsize=1,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stderr: collections.deque[str] = collections.deque(maxlen=40)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        threading.Thread(target=self._pump, args=(self.proc.stdout, self._lines.put),
                         daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self._stderr.append),
                         daemon=True).start()

    @staticmethod
    def _pump(stream: IO[str], sink: Any) -> None:
        for line in stream:
            sink(line.rstrip("\n"))
        sink(None)

    def stderr_tail(self) -> str:
        return "\n".join(line for line in self._stderr if line is not None)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except OSError as exc:
            raise self._failure(f"cannot write to it ({exc})") from exc

    def recv(self, timeout: float) -> dict[str, Any]:
        """Next JSON object on stdout; other lines (stray prints) are skipped."""
        while True:
            try:
                line = self._lines.get(timeout=timeout)
            except queue.Empty:
                raise self._failure(f"no answer within {timeout:.0f} s") from None
            if line is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(2.0)
                raise self._failure(f"exited with code {self.proc.returncode}")
            if line.startswith("{"):
                return dict(json.loads(line))

    def _failure(self, what: str) -> BenchError:
        tail = self.stderr_tail()
        return BenchError(f"{self.name} {what}" + (f"; its stderr:\n{tail}" if tail else ""))

    def stop(self, timeout: float = 5.0) -> None:
        """EOF on stdin first (a clean exit), then SIGTERM, then SIGKILL."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None and self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout)
                return
            except subprocess.TimeoutExpired:
                continue


class Children:
    """A context manager that stops every child it started, whatever happens."""

    def __init__(self) -> None:
        self.children: list[Child] = []

    def start(self, name: str, module: str, args: list[str], env: dict[str, str],
              prefix: Sequence[str] = (), python: str = sys.executable) -> Child:
        child = Child(name, module, args, env, prefix, python)
        self.children.append(child)
        return child

    def __iter__(self) -> Any:
        return iter(self.children)

    def __enter__(self) -> Children:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for child in self.children:
            if child.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    child.proc.stdin.close()
        for child in self.children:
            child.stop(timeout=5.0 if exc is None else 1.0)


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time the processes used so far (/proc/PID/stat), 0 for gone ones."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat
    return total / os.sysconf("SC_CLK_TCK")
