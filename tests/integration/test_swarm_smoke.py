"""The results benchmark end to end, small: `python -m bench.swarm --smoke` runs one system
of each kind (DDP, Moshpit SGD, hivemind in both modes; the DiLoCo rows have their worker test,
test_swarm_diloco_worker.py, and DDP's fp16 hook is in test_swarm_worker.py) on 4 emulated
hosts (network namespaces, CPU cgroups) with the tiny model for 12 s each, the hivemind rows
with periods of their own sized to that budget, then scores the models and writes the table
and plot.

Asserts what a broken benchmark would not produce: at least one completed sync per system, a
held-out loss of the hosts' mean model at the deadline (the end rule) below the untrained
model's on the same bytes, for the hivemind rows too, moshpit's hosts ending on the same model
after its own final sync, and the table and PNG on disk. Needs root, ip/tc/nft, a writable CPU
cgroup and .venv-peers (`make peers`); skips with the reason otherwise.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.swarm.orchestrator import PEERS_PYTHON
from bench.swarm.systems import HIVEMIND_SYSTEMS, SMOKE_SYSTEMS
from bench.swarm.systems.hivemind_settings import SMOKE_KNOBS
from netlab import missing_prerequisites
from tests.integration.helpers import run_swarm_smoke

pytestmark = pytest.mark.timeout(420)


def test_smoke_runs_every_system(tmp_path: Path) -> None:
    reason = missing_prerequisites(need_cgroup=True)
    if reason:
        pytest.skip(reason)
    if not PEERS_PYTHON.exists():
        pytest.skip(f"{PEERS_PYTHON} missing (`make peers` builds it; `make test` does)")
    out = tmp_path / "swarm"
    results, stderr = run_swarm_smoke(out)
    scen = results["scenarios"]["lan"]
    rows = {row["system"]: row for row in scen["rows"]}
    assert set(rows) == set(SMOKE_SYSTEMS), stderr[-6000:]
    for system, row in rows.items():
        assert row["syncs_ok"] >= 1, (system, row, stderr[-4000:])
        # the end rule: every host's model at the deadline, averaged, on the held-out bytes
        assert (row["end_models"], row["held_out_windows"]) == (4, 512), (system, row)
        assert math.isfinite(row["loss_end"]), (system, row)
        assert row["loss_end"] < row["loss_start"] - 0.1, (system, row["loss_end"],
                                                          row["loss_start"])
        assert row["curve"][0]["t"] == 0.0
        assert row["curve"][-1]["loss"] < row["curve"][0]["loss"], (system, row["curve"])
        assert row["bytes_total"] > 0, (system, row)
    for system in HIVEMIND_SYSTEMS:  # the smoke's own periods, and each host's bandwidth
        record = json.loads((out / "lan" / system / "seed0" / "run.json").read_text())
        knobs = record["workers"][0]["spec"]["knobs"]
        assert knobs == {**SMOKE_KNOBS[system], "bandwidth": 1000.0}, knobs
    assert rows["moshpit"]["final_models"]["agree"], rows["moshpit"]["final_models"]
    assert results["target_source"].startswith("DDP on lan")
    assert "no verdict" in scen["verdicts"]["loss_end"]["text"]  # one seed: a ranking only
    table = (out / "results.md").read_text()
    for system in SMOKE_SYSTEMS:
        assert f"| {system} | 0 |" in table
    assert "mean of the hosts' models at the end of the budget" in table
    png = (out / "lan.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000
