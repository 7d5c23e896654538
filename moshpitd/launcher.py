"""Start real moshpitd processes on loopback: for the demo, benchmarks and tests.

Each daemon binds port 0 everywhere and reports what it bound in its ready file, so nothing
here guesses ports or sleeps for a fixed time.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType


class LaunchError(RuntimeError):
    """A daemon did not come up."""


@dataclass
class DaemonProcess:
    name: str
    workdir: Path
    proc: subprocess.Popen[bytes]
    info: dict[str, str] = field(default_factory=dict)

    @property
    def socket(self) -> str:
        return self.info["ipc"]

    @property
    def dht(self) -> str:
        return self.info["dht"]

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then SIGKILL if it does not exit in time; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


def start_daemon(name: str, workdir: Path, bootstrap: list[str] | None = None,
                 log_level: str = "INFO", extra_args: list[str] | None = None,
                 host: str = "127.0.0.1", ready_timeout: float = 20.0,
                 wait: bool = True, env: dict[str, str] | None = None,
                 command: list[str] | None = None) -> DaemonProcess:
    """`command` is the program and its first arguments (default: this interpreter's
    `-m moshpitd`), e.g. an installed entry point run apart from the source tree."""
    workdir.mkdir(parents=True, exist_ok=True)
    ready = workdir / f"{name}.ready.json"
    with contextlib.suppress(FileNotFoundError):
        ready.unlink()
    args = [
        *(command or [sys.executable, "-m", "moshpitd"]),
        "--dht-listen", f"{host}:0", "--grpc-listen", f"{host}:0",
        "--metrics-listen", f"{host}:0",
        "--ipc-socket", str(workdir / f"{name}.sock"),
        "--ready-file", str(ready), "--log-level", log_level,
        "--peer-key-file", str(workdir / f"{name}.peer.key"),  # its identity, kept over restarts
    ]
    if bootstrap:
        args += ["--bootstrap", ",".join(bootstrap)]
    args += extra_args or []
    log = open(workdir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
    try:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, **(env or {})})
    finally:
        log.close()
    daemon = DaemonProcess(name, workdir, proc)
    daemon.info = {"ready_file": str(ready)}
    if wait:
        wait_ready(daemon, ready_timeout)
    return daemon


def wait_ready(daemon: DaemonProcess, timeout: float = 20.0) -> None:
    ready = Path(daemon.info["ready_file"])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready.exists():
            daemon.info = {**json.loads(ready.read_text()), "ready_file": str(ready)}
            return
        if daemon.proc.poll() is not None:
            raise LaunchError(f"daemon {daemon.name} exited with {daemon.proc.returncode}:\n"
                              f"{daemon.log_tail()}")
        time.sleep(0.02)
    daemon.kill()
    raise LaunchError(f"daemon {daemon.name} not ready within {timeout} s:\n{daemon.log_tail()}")


class LocalSwarm:
    """N daemons on loopback, the first one the others' bootstrap; a context manager."""

    def __init__(self, size: int, workdir: str | Path | None = None, log_level: str = "INFO",
                 extra_args: list[str] | None = None,
                 env_by_index: dict[int, dict[str, str]] | None = None) -> None:
        self.size = size
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="moshpit-swarm-")
            workdir = self._tmp.name
        self.workdir = Path(workdir)
        self.log_level = log_level
        self.extra_args = extra_args or []
        self.env_by_index = env_by_index or {}
        self.daemons: list[DaemonProcess] = []

    def start(self) -> LocalSwarm:
        try:
            first = start_daemon("d0", self.workdir, log_level=self.log_level,
                                 extra_args=self.extra_args, env=self.env_by_index.get(0))
            self.daemons.append(first)
            rest = []
            for i in range(1, self.size):  # owned as soon as started: stop() reaches them all
                d = start_daemon(f"d{i}", self.workdir, [first.dht], self.log_level,
                                 self.extra_args, wait=False, env=self.env_by_index.get(i))
                self.daemons.append(d)
                rest.append(d)
            for d in rest:
                wait_ready(d)
        except BaseException:
            self.stop()
            raise
        return self

    def add(self, name: str | None = None) -> DaemonProcess:
        boot = [d.dht for d in self.daemons if d.alive()][:3]
        d = start_daemon(name or f"d{len(self.daemons)}", self.workdir, boot, self.log_level,
                         self.extra_args)
        self.daemons.append(d)
        return d

    @property
    def sockets(self) -> list[str]:
        return [d.socket for d in self.daemons]

    def stop(self) -> list[int]:
        codes = [d.stop() for d in self.daemons]
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        return codes

    def __enter__(self) -> LocalSwarm:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def main() -> int:
    """python -m moshpitd.launcher N: run N daemons until Ctrl-C, printing their sockets."""
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    with LocalSwarm(size) as swarm:
        for d in swarm.daemons:
            print(json.dumps({"name": d.name, **d.info}), flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
