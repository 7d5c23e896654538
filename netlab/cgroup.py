"""A per-host CPU cgroup: an equal CPU quota for every process of one emulated host.

Supports cgroup v2 (`cpu.max`, `cpu.stat` usage_usec, `cgroup.kill`) and cgroup v1 (the `cpu`
controller's `cpu.cfs_quota_us`; usage from `cpuacct.usage`, in the same directory when the
controllers are mounted together, else in a sibling `cpuacct` group the processes join too).
A process joins before it execs (see `join_command`), so everything it forks or spawns later
(hivemind's helper processes, its Go daemon) is counted against the same quota.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


class CgroupError(RuntimeError):
    """No writable cgroup CPU controller here (the message says what was tried)."""


def _v2_root(root: Path) -> Path | None:
    return root if (root / "cgroup.controllers").exists() else None


def _v1_cpu_root(root: Path) -> Path | None:
    for name in ("cpu", "cpu,cpuacct"):
        if (root / name / "cpu.cfs_quota_us").exists():
            return root / name
    return None


def cgroup_problem(root: Path = ROOT) -> str | None:
    """Why no CPU cgroup can be made here, or None if one can."""
    base = _v2_root(root) or _v1_cpu_root(root)
    if base is None:
        return (f"no cgroup CPU controller under {root} (neither cgroup v2 cpu.max nor v1 "
                "cpu/cpu.cfs_quota_us)")
    if not os.access(base, os.W_OK):
        return f"{base} is not writable (creating a CPU cgroup needs root)"
    if _v2_root(root) is not None:
        controllers = (root / "cgroup.subtree_control").read_text().split()
        if "cpu" not in controllers and not os.access(root / "cgroup.subtree_control", os.W_OK):
            return f"the cpu controller is not enabled in {root}/cgroup.subtree_control"
    return None


@dataclass
class CpuGroup:
    """One cgroup named `name` with a quota of `cores` CPUs (None: no limit, still counted)."""

    name: str
    cores: float | None
    root: Path = ROOT
    version: int = 0
    dirs: list[Path] = field(default_factory=list)  # every directory created, quota one first

    def create(self) -> CpuGroup:
        problem = cgroup_problem(self.root)
        if problem:
            raise CgroupError(problem)
        v2 = _v2_root(self.root)
        if v2 is not None:
            self.version = 2
            control = v2 / "cgroup.subtree_control"
            if "cpu" not in control.read_text().split():
                control.write_text("+cpu")
            self._mkdir(v2 / self.name)
            limit = "max" if self.cores is None else str(max(1000, int(self.cores * PERIOD_US)))
            (self.dirs[0] / "cpu.max").write_text(f"{limit} {PERIOD_US}")
            return self
        cpu_root = _v1_cpu_root(self.root)
        assert cpu_root is not None
        self.version = 1
        cpu = self._mkdir(cpu_root / self.name)
        (cpu / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        quota = -1 if self.cores is None else max(1000, int(self.cores * PERIOD_US))
        (cpu / "cpu.cfs_quota_us").write_text(str(quota))
        acct_root = self.root / "cpuacct"
        if not (cpu / "cpuacct.usage").exists() and (acct_root / "cpuacct.usage").exists():
            self._mkdir(acct_root / self.name)
        return self

    def _mkdir(self, path: Path) -> Path:
        try:
            path.mkdir(exist_ok=True)
        except OSError as exc:
            raise CgroupError(f"cannot create cgroup {path}: {exc}") from exc
        self.dirs.append(path)
        return path

    @property
    def procs_files(self) -> list[Path]:
        return [d / "cgroup.procs" for d in self.dirs]

    def join_command(self, args: list[str]) -> list[str]:
        """`args` wrapped so the process joins this group before it execs: nothing it starts
        can escape, and the caller needs no preexec hook (unsafe with threads)."""
        files = " ".join(f"'{p}'" for p in self.procs_files)
        script = f'for f in {files}; do echo $$ > "$f" || exit 97; done; exec "$@"'
        return ["sh", "-c", script, "sh", *args]

    def pids(self) -> list[int]:
        if not self.dirs:
            return []
        try:
            text = (self.dirs[0] / "cgroup.procs").read_text()
        except FileNotFoundError:
            return []
        return [int(p) for p in text.split()]

    def cpu_seconds(self) -> float:
        """CPU time used by every process that was ever in the group."""
        if not self.dirs:
            return 0.0
        if self.version == 2:
            for line in (self.dirs[0] / "cpu.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "usage_usec":
                    return int(value) / 1e6
            return 0.0
        for d in self.dirs:
            usage = d / "cpuacct.usage"
            if usage.exists():
                return int(usage.read_text()) / 1e9
        return 0.0

    def throttled_seconds(self) -> float:
        """Time the quota held the group back (a CPU-bound host shows it)."""
        if not self.dirs:
            return 0.0
        for line in (self.dirs[0] / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "throttled_usec":
                return int(value) / 1e6
            if key == "throttled_time":
                return int(value) / 1e9
        return 0.0

    def kill(self, timeout: float = 10.0) -> int:
        """SIGKILL every process in the group (a preemption); returns how many there were."""
        victims = self.pids()
        kill_file = self.dirs[0] / "cgroup.kill" if self.dirs else None
        if kill_file is not None and kill_file.exists():
            kill_file.write_text("1")
        deadline = time.monotonic() + timeout
        while True:
            pids = self.pids()
            if not pids:
                return len(victims)
            for pid in pids:  # v1: processes forking meanwhile are caught by the next pass
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            victims.extend(p for p in pids if p not in victims)
            if time.monotonic() > deadline:
                raise CgroupError(f"cgroup {self.name} still has processes {pids} after SIGKILL")
            time.sleep(0.02)

    def remove(self) -> None:
        """Kill what is left and remove the directories."""
        if not self.dirs:
            return
        with contextlib.suppress(CgroupError):
            self.kill()
        for d in reversed(self.dirs):
            for _ in range(50):  # a killed process leaves the group once it is reaped
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)
        self.dirs.clear()
