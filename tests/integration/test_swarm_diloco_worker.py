"""bench.swarm's DiLoCo rows at the worker level: two workers in real processes, each with its
own moshpitd on loopback (no namespaces, so it runs where the smoke test cannot, and costs
one pair of processes instead of a whole emulated scenario).

Host 0 trains from the start; host 1 comes back as the orchestrator starts a preempted host:
`rejoin`, so it first downloads the global copy and the outer state that host 0 publishes,
then trains until the common end. The row is the streaming one with int4 (fragments, delay,
error feedback: the most code of the three rows). Asserts: host 1 resumed at host 0's step
count (not from 0), both hosts trained and took outer steps, the final outer sync and the
parameter average gathered both hosts (after each saved the model the benchmark scores, at the
deadline), and their final models are identical and better than the untrained one.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.procs import Child, Children, child_env
from bench.swarm.corpus import CorpusNotFound, load_corpus
from bench.swarm.evaluation import initial_loss
from bench.swarm.workload import evaluate
from moshpitd.launcher import LocalSwarm

pytestmark = pytest.mark.timeout(150)

BUDGET_S = 4.0
# join_runs off: it gathers every host before the clock starts, and host 1 is not there
KNOBS = {"every": 8, "fragments": 2, "delay": 1, "codec": "int4", "grid": [2, 1],
         "final_group": 2, "timeout": 20.0, "publish_steps": 4, "join_runs": False}


def _spec(tmp: Path, host: int, socket: str, rejoin: bool) -> Path:
    spec = {"system": "diloco-stream", "host": host, "hosts": 2,
            "host_ips": ["127.0.0.1", "127.0.0.1"], "port_base": 0, "seed": 0,
            "model": "tiny", "batch": 4, "seq_len": 64, "lr": 1e-3, "weight_decay": 0.1,
            "budget_s": BUDGET_S, "start_at": None, "start_file": str(tmp / "start"),
            "out_dir": str(tmp / f"h{host}"), "shared_dir": str(tmp / "shared"),
            "snapshot_every_s": 60.0, "rejoin": rejoin, "ipc_socket": socket,
            "knobs": KNOBS}
    path = tmp / f"spec-h{host}.json"
    path.write_text(json.dumps(spec))
    return path


def _until(child: Child, kind: str, timeout: float) -> list[dict[str, Any]]:
    """Events up to and including the first of `kind`; fails on an `error` event."""
    events = []
    while True:
        event = child.recv(timeout)
        events.append(event)
        assert event["event"] != "error", (event, child.stderr_tail())
        if event["event"] == kind:
            return events


def test_diloco_worker_rejoins_from_the_global_copy_and_ends_agreed(
        tmp_path: Path, swarm_factory: Any) -> None:
    try:
        load_corpus()
    except CorpusNotFound as exc:
        pytest.skip(f"no corpus: {exc}")
    swarm: LocalSwarm = swarm_factory(2)
    env = child_env()
    with Children() as kids:
        first, back = (kids.start(f"host {h}", "bench.swarm.worker",
                                  ["--spec", str(_spec(tmp_path, h, swarm.sockets[h], h == 1))],
                                  env) for h in (0, 1))
        events0 = _until(first, "ready", 90)
        part = tmp_path / "start.tmp"
        part.write_text(f"{time.time() + 0.2}\n")
        os.replace(part, tmp_path / "start")
        events1 = _until(back, "ready", 90)  # after its download of host 0's state
        events0 += _until(first, "done", 90)
        events1 += _until(back, "done", 90)
    rejoined = next(e for e in events1 if e["event"] == "rejoined")
    assert "error" not in rejoined and rejoined["step"] >= KNOBS["publish_steps"], rejoined
    done0, done1 = events0[-1], events1[-1]
    assert done1["step"] > rejoined["step"] and done0["step"] > 0
    for events in (events0, events1):
        syncs = [e for e in events if e["event"] == "sync"]
        assert any(e["ok"] and not e.get("final") for e in syncs), syncs
        final = [e for e in syncs if e.get("final")]
        # the outer step of what was left, then the average of the parameters
        assert [(e["ok"], e["group_size"]) for e in final] == [(True, 2), (True, 2)], final
        # the model the benchmark scores is saved at the deadline, before those syncs
        scored = next(i for i, e in enumerate(events) if e["event"] == "budget")
        assert scored < events.index(final[0]) and events[scored]["late_s"] >= 0.0
    models = [torch.load(e["path"], map_location="cpu", weights_only=True)
              for e in (done0, done1)]
    for name, value in models[0].items():
        assert torch.equal(value, models[1][name]), name
    loss = evaluate(models[0], model="tiny")
    assert math.isfinite(loss) and loss < initial_loss("tiny") - 0.3, loss
