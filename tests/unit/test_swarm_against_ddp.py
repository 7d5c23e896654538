"""bench.swarm's yardstick against DDP on the same scenario and seed: when each row's curve
reaches the loss DDP's curve ended at, the bytes sent by then, and bytes per sample against
DDP's."""

from __future__ import annotations

import math
from typing import Any

from bench.swarm import metrics, report


def _record(system: str, tx_per_s: float, hosts: int = 2, seed: int = 0) -> dict[str, Any]:
    """Every host sends tx_per_s bytes a second for 100 s from start_at = 1000."""
    samples = [{"t": 1000.0 + s, "tx": [tx_per_s * s] * hosts} for s in range(0, 101, 10)]
    return {"scenario": "wan", "system": system, "start_at": 1000.0, "seed": seed,
            "config": {"hosts": hosts}, "samples": samples}


def _row(system: str, curve: list[tuple[float, float]], samples: int, sent: float
         ) -> dict[str, Any]:
    return {"system": system, "curve": [{"t": t, "loss": x} for t, x in curve],
            "loss_end": curve[-1][1], "samples_processed": samples, "bytes_total": sent}


def test_time_and_bytes_to_ddps_final_loss_and_per_sample_ratio() -> None:
    ddp, fast = _record("ddp", 2e6), _record("diloco-fp16", 1e4)
    rows = {id(ddp): _row("ddp", [(0, 5.0), (50, 4.0), (100, 3.0)], 200, 2e8),
            id(fast): _row("diloco-fp16", [(0, 5.0), (20, 3.5), (40, 2.5), (100, 2.0)],
                           1000, 1e6)}
    metrics.against_ddp([ddp, fast], rows)
    mine = rows[id(fast)]
    assert mine["ddp_end_loss"] == 3.0
    assert math.isclose(mine["time_to_ddp_end"], 30.0)  # halfway from 3.5 at 20 s to 2.5 at 40
    assert math.isclose(mine["bytes_to_ddp_end"], 30 * 1e4)
    assert math.isclose(rows[id(ddp)]["time_to_ddp_end"], 100.0)
    # bytes per sample: mean bytes per host x hosts / samples processed
    assert math.isclose(rows[id(ddp)]["bytes_per_sample"], 2e8 * 2 / 200)
    assert math.isclose(mine["bytes_per_sample"], 1e6 * 2 / 1000)
    text = report.ddp_table([rows[id(ddp)], mine])
    assert "| diloco-fp16 | 0 | 30 s | 0.3 MB | 2.0 kB | 1000x |" in text, text
    assert "| ddp | 0 | 100 s | 200.0 MB | 2000.0 kB | 1x |" in text, text


def test_a_row_that_never_reaches_it_and_a_scenario_without_ddp() -> None:
    ddp, slow = _record("ddp", 1e6), _record("moshpit", 1e5)
    other = dict(_record("moshpit", 1e5), scenario="lan")
    rows = {id(ddp): _row("ddp", [(0, 5.0), (100, 3.0)], 100, 1e8),
            id(slow): _row("moshpit", [(0, 5.0), (100, 3.5)], 100, 1e7),
            id(other): _row("moshpit", [(0, 5.0), (100, 3.5)], 0, 1e7)}
    metrics.against_ddp([ddp, slow, other], rows)
    assert rows[id(slow)]["time_to_ddp_end"] is None
    assert rows[id(slow)]["bytes_to_ddp_end"] is None
    assert "ddp_end_loss" not in rows[id(other)]
    assert math.isnan(rows[id(other)]["bytes_per_sample"])  # no sample processed
    assert "| moshpit | 0 | - | - | 200.0 kB | 10x |" in report.ddp_table(
        [rows[id(ddp)], rows[id(slow)]])


def test_each_seed_is_measured_against_ddp_of_the_same_seed() -> None:
    """Seeds differ in data order: a row's yardstick is DDP's curve of its own seed, and the
    loss on the curves' scale (DDP's last curve point), not its held-out loss at the end."""
    ddp0, ddp1 = _record("ddp", 1e6, seed=0), _record("ddp", 1e6, seed=1)
    mine0, mine1 = _record("moshpit", 1e5, seed=0), _record("moshpit", 1e5, seed=1)
    curve = [(0, 5.0), (50, 4.0), (100, 3.0)]
    rows = {id(ddp0): dict(_row("ddp", [(0, 5.0), (100, 4.0)], 100, 1e8), loss_end=9.9),
            id(ddp1): _row("ddp", [(0, 5.0), (100, 3.5)], 100, 1e8),
            id(mine0): _row("moshpit", curve, 100, 1e7),
            id(mine1): _row("moshpit", curve, 100, 1e7)}
    metrics.against_ddp([ddp0, ddp1, mine0, mine1], rows)
    assert rows[id(mine0)]["ddp_end_loss"] == 4.0  # the curve's end, not loss_end (9.9)
    assert math.isclose(rows[id(mine0)]["time_to_ddp_end"], 50.0)
    assert rows[id(mine1)]["ddp_end_loss"] == 3.5
    assert math.isclose(rows[id(mine1)]["time_to_ddp_end"], 75.0)
