"""Run each system once: P peers, one warm-up and R timed repeats, raw per-repeat numbers out.

A repeat's time is the slowest peer's (the round is done when the last peer is done).
"""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass, field
from typing import Any

from bench.procs import BenchError, Child, Children, child_env, cpu_seconds


@dataclass
class Samples:
    """Per-repeat numbers of one system; the extra lists are moshpit-only."""

    system: str
    seconds: list[float] = field(default_factory=list)
    daemon_seconds: list[float] = field(default_factory=list)
    matchmaking_seconds: list[float] = field(default_factory=list)
    overhead_seconds: list[float] = field(default_factory=list)
    reduce_seconds: list[float] = field(default_factory=list)
    daemon_cpu_seconds: list[float] = field(default_factory=list)  # all daemons, per repeat
    wire_bytes: list[int] = field(default_factory=list)  # sent plus received, all daemons
    partial_rounds: int = 0  # timed repeats whose peers did not all land in one group
    max_error: float = 0.0


def merge(runs: list[Samples]) -> Samples:
    """One system's samples from several passes, as if from one run."""
    out = Samples(runs[0].system)
    for s in runs:
        for name in ("seconds", "daemon_seconds", "matchmaking_seconds", "overhead_seconds",
                     "reduce_seconds", "daemon_cpu_seconds", "wire_bytes"):
            getattr(out, name).extend(getattr(s, name))
        out.partial_rounds += s.partial_rounds
        out.max_error = max(out.max_error, s.max_error)
    return out


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _answers(children: list[Child], timeout: float) -> list[dict[str, Any]]:
    """One reply from every child; one error among them fails the whole step."""
    replies = [c.recv(timeout) for c in children]
    errors = [f"{c.name}: {r['error']}" for c, r in zip(children, replies, strict=True)
              if "error" in r]
    if errors:
        sizes = sorted(r["group_size"] for r in replies if "group_size" in r)
        hint = (f"\nthe other peers finished in groups of sizes {sizes}, without the failed "
                "one(s); --min-group-size equal to --peers forbids that" if sizes else "")
        raise BenchError("\n".join(errors) + hint)
    return replies


def run_moshpit(peers: int, elems: int, repeat: int, timeout: float,
                workdir: str | None = None, log_level: str = "INFO",
                min_group_size: int = 2, codec: str = "none", ipc: str = "shared",
                aggregation: str = "mean", encrypted: bool = False,
                checked: bool = False) -> Samples:
    """Daemons from LocalSwarm, one worker process per daemon, stepped with `go` lines;
    `encrypted`: under a swarm key, so every data-plane frame is sealed (AES-256-GCM), with
    results checked (`checked`, the key's default) or not."""
    import os
    import tempfile
    from pathlib import Path

    from moshpitd.launcher import LaunchError, LocalSwarm

    out = Samples("moshpit-checked" if checked else
                  "moshpit-encrypted" if encrypted else "moshpit")
    extra: list[str] = []
    keydir = tempfile.TemporaryDirectory(prefix="moshpit-bench-key-")
    encrypted = encrypted or checked
    if encrypted:
        key_file = Path(keydir.name) / "swarm.key"
        key_file.write_text(os.urandom(32).hex())
        key_file.chmod(0o600)
        extra = ["--swarm-key-file", str(key_file),
                 "--check-results", "on" if checked else "off"]
    try:
        swarm = LocalSwarm(peers, workdir=workdir, log_level=log_level,
                           extra_args=extra).start()
    except LaunchError as exc:
        raise BenchError(f"moshpit swarm did not start: {exc}") from exc
    try:
        _log(f"moshpit: {peers} daemons up in {swarm.workdir}")
        with Children() as kids:
            workers = [
                kids.start(f"moshpit worker {i}", "bench.worker",
                           ["--socket", sock, "--rank", str(i), "--peers", str(peers),
                            "--elems", str(elems), "--timeout", str(timeout),
                            "--min-group-size", str(min_group_size), "--codec", codec,
                            "--ipc", ipc, "--aggregation", aggregation], child_env())
                for i, sock in enumerate(swarm.sockets)]
            _answers(workers, timeout=120.0)
            for rep in range(1 + repeat):
                key = f"bench-{rep}"
                cpu = cpu_seconds([d.proc.pid for d in swarm.daemons])
                for w in workers:
                    w.send(f"go {key}")
                replies = _answers(workers, timeout=timeout + 30.0)
                cpu = cpu_seconds([d.proc.pid for d in swarm.daemons]) - cpu
                sizes = sorted(r["group_size"] for r in replies)
                for w in workers:  # now that no round runs any more
                    w.send("check")
                errors = [r["max_error"] for r in _answers(workers, timeout=120.0)
                          if r["max_error"] is not None]
                out.max_error = max(out.max_error, *errors, 0.0)
                label = "warm-up" if rep == 0 else f"repeat {rep}/{repeat}"
                _log(f"moshpit {label}: {max(r['seconds'] for r in replies):.3f} s"
                     + ("" if sizes[0] == peers else f"; SPLIT: peers' group sizes {sizes}"))
                if rep == 0:
                    continue
                out.partial_rounds += sizes[0] != peers
                out.seconds.append(max(r["seconds"] for r in replies))
                out.daemon_cpu_seconds.append(cpu)
                out.wire_bytes.append(2 * sum(r["bytes_sent"] for r in replies))
                out.daemon_seconds.append(max(r["daemon_seconds"] for r in replies))
                out.matchmaking_seconds.append(max(r["matchmaking_seconds"] for r in replies))
                out.reduce_seconds.append(max(r["daemon_seconds"] - r["matchmaking_seconds"]
                                              for r in replies))
                out.overhead_seconds.extend(r["seconds"] - r["daemon_seconds"] for r in replies)
            for w in workers:
                w.send("quit")
    except BenchError as exc:
        logs = "\n".join(f"--- {d.name} log tail ---\n{d.log_tail(15)}" for d in swarm.daemons)
        raise BenchError(f"{exc}\n{logs}") from exc
    finally:
        dead = [d.name for d in swarm.daemons if not d.alive()]
        codes = swarm.stop()
        keydir.cleanup()
        if dead or any(codes):
            _log(f"moshpit daemons: died early {dead}, exit codes {codes}")
    return out


def free_port() -> int:
    """A port that was free a moment ago; gloo's TCP store binds it right after."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_gloo(peers: int, elems: int, repeat: int, timeout: float) -> Samples:
    """P ranks of torch.distributed over loopback; each reports all its times at the end."""
    out = Samples("gloo")
    port = free_port()
    env = child_env(GLOO_SOCKET_IFNAME="lo")
    with Children() as kids:
        ranks = [kids.start(f"gloo rank {r}", "bench.gloo_worker",
                            ["--rank", str(r), "--peers", str(peers), "--port", str(port),
                             "--elems", str(elems), "--repeat", str(repeat),
                             "--timeout", str(timeout)], env)
                 for r in range(peers)]
        replies = _answers(ranks, timeout=60.0 + timeout * (1 + repeat))
    _log(f"gloo warm-up: {max(max(r['warmup']) for r in replies):.3f} s")
    out.seconds = [max(times) for times in zip(*(r["times"] for r in replies), strict=True)]
    out.max_error = max(r["max_error"] for r in replies)
    return out
