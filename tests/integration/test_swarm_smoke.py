"""The results benchmark end to end, small: `python -m bench.swarm --smoke` runs one system
of each kind (DDP, Moshpit SGD, hivemind in both modes; the DiLoCo rows have their worker test,
test_swarm_diloco_worker.py) on 4 emulated hosts (network namespaces, CPU cgroups)
with the tiny model for 12 s each, then evaluates the snapshots and writes the table and plot.

Asserts what a broken benchmark would not produce: at least one completed sync per system, a
finite validation loss below the untrained model's, moshpit's hosts ending on the same model,
and the table and PNG on disk. Needs root, ip/tc/nft, a writable CPU cgroup and .venv-peers
(`make peers`); skips with the reason otherwise.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench.swarm.orchestrator import PEERS_PYTHON
from bench.swarm.systems import SMOKE_SYSTEMS
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
    rows = {row["system"]: row for row in results["scenarios"]["lan"]["rows"]}
    assert set(rows) == set(SMOKE_SYSTEMS), stderr[-6000:]
    start = None
    for system, row in rows.items():
        assert row["syncs_ok"] >= 1, (system, row, stderr[-4000:])
        assert math.isfinite(row["loss_end"]) and row["loss_end_from_done"], (system, row)
        start = row["curve"][0]["loss"]
        assert row["curve"][0]["t"] == 0.0
        assert row["loss_end"] < start, (system, row["curve"])
        assert row["bytes_total"] > 0, (system, row)
    assert rows["moshpit"]["final_models"]["agree"], rows["moshpit"]["final_models"]
    assert results["target_source"].startswith("DDP on lan")
    table = (out / "results.md").read_text()
    for system in SMOKE_SYSTEMS:
        assert f"| {system} |" in table
    png = (out / "lan.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000
