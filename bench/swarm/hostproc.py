"""One worker process on one emulated host: started in the host's namespace and cgroup, its
JSON-lines stdout collected by a reader thread (see the worker contract in
bench/swarm/worker.py)."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from netlab import Host, Topology

REPO = Path(__file__).resolve().parents[2]


@dataclass
class WorkerProcess:
    """A trainer's incarnation: `gen` counts restarts on its host (DDP generations, rejoins);
    a host with several trainers has one of these per trainer and generation."""

    host: int  # 0-based
    gen: int
    spec: dict[str, Any]
    spec_path: Path
    started: float
    proc: subprocess.Popen[bytes] | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    killed_at: float | None = None  # set when the orchestrator killed it (preemption, restart)
    kill_reason: str = ""
    returncode: int | None = None
    _reader: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def start(cls, topo: Topology, host: Host, python: str, spec: dict[str, Any], gen: int
              ) -> WorkerProcess:
        out_dir = Path(spec["out_dir"])
        out_dir.mkdir(parents=True, exist_ok=True)
        spec_path = out_dir / f"spec-g{gen}.json"
        spec_path.write_text(json.dumps(spec, indent=1))
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")
        worker = cls(spec["host"], gen, spec, spec_path, time.time())
        with open(out_dir / f"worker-g{gen}.log", "ab") as log:
            worker.proc = topo.spawn(host, [python, "-m", "bench.swarm.worker",
                                            "--spec", str(spec_path)],
                                     stdout=subprocess.PIPE, stderr=log, env=env, cwd=REPO)
        worker._reader = threading.Thread(
            target=worker._read, daemon=True,
            name=f"worker-h{worker.host}-t{spec.get('trainer', 0)}-g{gen}")
        worker._reader.start()
        return worker

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").strip()
            if not line:
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                event = None
            if not isinstance(event, dict) or "event" not in event:
                event = {"event": "stdout", "text": line[:500]}
            event.setdefault("t", time.time())
            event["recv"] = time.time()
            with self._lock:
                self.events.append(event)

    def snapshot_events(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.events)

    def last(self, kind: str) -> dict[str, Any] | None:
        with self._lock:
            for event in reversed(self.events):
                if event["event"] == kind:
                    return event
        return None

    def count(self, kind: str, **match: Any) -> int:
        with self._lock:
            return sum(1 for e in self.events if e["event"] == kind
                       and all(e.get(k) == v for k, v in match.items()))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def mark_killed(self, reason: str) -> None:
        if self.killed_at is None:
            self.killed_at = time.time()
            self.kill_reason = reason

    def finish(self, timeout: float = 10.0) -> None:
        """Reap the process and let the reader drain what it printed."""
        if self.proc is not None:
            try:
                self.returncode = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.returncode = self.proc.wait()
        if self._reader is not None:
            self._reader.join(timeout)

    def log_tail(self, lines: int = 20) -> str:
        path = Path(self.spec["out_dir"]) / f"worker-g{self.gen}.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "gen": self.gen, "spec": self.spec,
                "started": self.started, "killed_at": self.killed_at,
                "kill_reason": self.kill_reason, "returncode": self.returncode,
                "events": self.snapshot_events()}
