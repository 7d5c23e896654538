"""From every run's record and losses to the results: one row per run, the target loss, and per
scenario each system's cells over its seeds (median and range) with the verdict
(bench/swarm/verdict.py)."""

from __future__ import annotations

import math
import statistics
from typing import Any

from bench.swarm import metrics
from bench.swarm.orchestrator import RunConfig
from bench.swarm.scenario import Scenario
from bench.swarm.verdict import Spread, spread, verdict

TARGET_RULE = ("the validation loss the DDP run of the `lan` scenario reaches at 80 % of its "
               "budget (linear between evaluated snapshots; the median over its seeds), unless "
               "--target overrides it; without either, the highest loss any row's curve had at "
               "80 % of its budget")
# (row key, label, format) of the cells aggregated over seeds; lower is better for the first
# two, which get a verdict each
CELLS = (("loss_end", "loss at end (held-out)", ".3f"),
         ("time_to_ddp_end", "time to DDP's final loss (s)", ".0f"),
         ("goodput", "goodput (samples/s)", ".1f"),
         ("bytes_total", "sent/host (MB)", ".1f"),
         ("cpu_busy", "CPU busy", ".2f"))
JUDGED = ("loss_end", "time_to_ddp_end")


def target_loss(records: list[dict[str, Any]], rows: dict[int, dict[str, Any]],
                given: float | None) -> tuple[float | None, str]:
    """The target and where it came from (TARGET_RULE)."""
    if given is not None:
        return given, "--target"
    lan = [metrics.loss_at(rows[id(r)]["curve"], 0.8 * r["config"]["budget_s"])
           for r in records if r["scenario"] == "lan" and r["system"] == "ddp"
           and rows[id(r)]["curve"]]
    if lan:
        return statistics.median(lan), "DDP on lan at 80 % of its budget"
    worst = [metrics.loss_at(rows[id(r)]["curve"], 0.8 * r["config"]["budget_s"])
             for r in records if rows[id(r)]["curve"]]
    if worst:
        return max(worst), "no DDP on lan: the highest loss a row's curve had at 80 % of its budget"
    return None, "no target: DDP on lan was not run and --target was not given"


def _spread_json(s: Spread | None, scale: float = 1.0) -> dict[str, Any] | None:
    if s is None:
        return None
    return {"median": s.median * scale, "low": s.low * scale, "high": s.high * scale,
            "runs": s.runs}


def seed_cells(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each system's cells over its runs, and a verdict per judged metric."""
    systems = list(dict.fromkeys(r["system"] for r in rows))
    by_system = {s: [r for r in rows if r["system"] == s] for s in systems}
    cells = {s: {key: _spread_json(spread([r.get(key, math.nan) for r in runs]))
                 for key, _, _ in CELLS} | {"runs": len(runs),
                                            "seeds": [r["seed"] for r in runs]}
             for s, runs in by_system.items()}
    verdicts = {}
    for key in JUDGED:
        label, spec = next((lab, sp) for k, lab, sp in CELLS if k == key)
        v = verdict({s: [r.get(key, math.nan) for r in runs] for s, runs in by_system.items()},
                    metric=label, spec=spec)
        verdicts[key] = {"text": v.text, "winner": v.winner,
                         "ranking": [{"system": r.system, "clears_next": r.clears_next}
                                     for r in v.ranking]}
    return {"cells": cells, "verdicts": verdicts}


def summarize(records: list[dict[str, Any]], losses: dict[str, float],
              scenarios: list[Scenario], configs: dict[str, RunConfig],
              given_target: float | None) -> dict[str, Any]:
    rows = {id(r): metrics.summarize(r, losses, None) for r in records}
    target, source = target_loss(records, rows, given_target)
    if target is not None:
        rows = {id(r): metrics.summarize(r, losses, target) for r in records}
    metrics.against_ddp(records, rows)
    entropy = None
    try:
        from bench.swarm.workload import train_entropy
        entropy = train_entropy()
    except Exception as exc:  # the table still stands without it
        print(f"unigram entropy unavailable: {exc}")
    out: dict[str, Any] = {"target": target, "target_source": source,
                           "target_rule": TARGET_RULE, "unigram_entropy": entropy,
                           "scenarios": {}}
    for s in scenarios:
        scen_rows = [rows[id(r)] for r in records if r["scenario"] == s.name]
        cfg = configs[s.name]
        out["scenarios"][s.name] = {
            "description": s.description, "config": cfg.to_json(),
            "links": [vars(link) for link in s.links_for(cfg.hosts)],
            "events": [vars(e) for e in s.events],
            "seeds": sorted({r["seed"] for r in scen_rows}),
            "rows": scen_rows, **seed_cells(scen_rows)}
    return out
