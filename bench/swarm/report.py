"""The results: a markdown table per scenario (one row per run; with several seeds, each
system's median and range and the verdict first), a PNG per scenario (validation loss against
wall clock and against bytes sent per host), and JSON for machines."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from bench.swarm.summary import CELLS

END_RULE = ("loss at end: the held-out loss ({kb:.0f} KB) of the mean of the hosts' models at "
            "the end of the budget, the same final average for every row (computed by the "
            "benchmark, untimed; a system's own final sync is not scored)")


def _fmt_bytes(n: float | None) -> str:
    if n is None or not math.isfinite(n):
        return "-"
    return f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


def table(rows: list[dict[str, Any]], target: float | None) -> str:
    head = ("| system | seed | time to target | bytes/host to target | loss at end "
            "| goodput (samples/s) | failures survived | syncs ok/all (mean s) | CPU busy "
            "| sent/host |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for row in rows:
        if target is None:
            ttt = "no target"
        elif row["time_to_target"] is None:
            ttt = "> budget"
        else:
            ttt = f"{row['time_to_target']:.0f} s"
        syncs = row["syncs_ok"] + row["syncs_failed"]
        fails = (f"{row['failures_survived']}/{row['preemptions']}" if row["preemptions"]
                 else "-")
        end = _fmt(row["loss_end"]) + ("" if row["end_models"] else " (no model)")
        lines.append(
            f"| {row['system']} | {row['seed']} | {ttt} | {_fmt_bytes(row['bytes_to_target'])} "
            f"| {end} "
            f"| {_fmt(row['goodput'], '.1f')} | {fails} "
            f"| {row['syncs_ok']}/{syncs} ({_fmt(row['sync_seconds_mean'], '.2f')}) "
            f"| {_fmt(100 * row['cpu_busy'], '.0f')} % | {_fmt_bytes(row['bytes_total'])} |")
    return "\n".join(lines)


def time_table(rows: list[dict[str, Any]]) -> str:
    """Where the time went: compute (the quota used), time inside sync calls, bytes."""
    head = ("| system | seed | CPU busy (of quota) | throttled s/host | in sync s/host "
            "| sent MB/s/host | samples processed | samples lost | last step past the end s "
            "| hosts' models apart at the end | delayer CPU s | machine load (mean/max) |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for row in rows:
        budget = row.get("budget_s") or math.nan
        lines.append(
            f"| {row['system']} | {row['seed']} | {_fmt(100 * row['cpu_busy'], '.0f')} % "
            f"| {_fmt(row['throttled_s'], '.1f')} | {_fmt(row['sync_seconds_per_host'], '.1f')} "
            f"| {_fmt(row['bytes_total'] / 1e6 / budget, '.2f')} | {row['samples_processed']} "
            f"| {row['samples_lost']} | {_fmt(row.get('late_s_max'), '.1f')} "
            f"| {_fmt(row.get('end_spread'), '.1e')} | {_fmt(row['delayer_cpu_s'], '.1f')} "
            f"| {_fmt(row.get('loadavg_mean'), '.1f')}/{_fmt(row.get('loadavg_max'), '.1f')} |")
    return "\n".join(lines)


def ddp_table(rows: list[dict[str, Any]]) -> str:
    """Against DDP on the same scenario: the time and bytes to DDP's final loss, and bytes
    per sample (DDP's over each row's: how many times fewer bytes a sample cost)."""
    base = {r.get("seed", 0): r for r in rows if r["system"] == "ddp"}
    head = ("| system | seed | time to DDP's final loss | bytes/host to it | bytes per sample "
            "| DDP's bytes per sample / this row's |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for row in rows:
        reached = row.get("time_to_ddp_end")
        ddp = base.get(row.get("seed", 0))
        ratio = (ddp["bytes_per_sample"] / row["bytes_per_sample"]
                 if ddp and row["bytes_per_sample"] else math.nan)
        lines.append(
            f"| {row['system']} | {row.get('seed', 0)} "
            f"| {'-' if reached is None else f'{reached:.0f} s'} "
            f"| {_fmt_bytes(row.get('bytes_to_ddp_end'))} "
            f"| {_fmt(row['bytes_per_sample'] / 1e3, '.1f')} kB | {_fmt(ratio, '.0f')}x |")
    return "\n".join(lines)


def seeds_table(scen: dict[str, Any]) -> str:
    """One line per system, in the order of the loss verdict's ranking: each cell the median
    [lowest, highest] over the system's runs, and whether its loss range clears the next
    row's (the verdict rule, bench/swarm/verdict.py)."""
    ranking = scen["verdicts"]["loss_end"]["ranking"]
    head = ("| system | runs | " + " | ".join(label for _, label, _ in CELLS)
            + " | loss range clears the next row's |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for place in ranking:
        cells = scen["cells"][place["system"]]
        out = []
        for key, _, spec in CELLS:
            c = cells.get(key)
            scale = 1e-6 if key == "bytes_total" else 1.0
            if c is None:
                out.append("-")
                continue
            lo, mid, hi = (_num(c[k] * scale, spec) for k in ("low", "median", "high"))
            out.append(mid if c["runs"] == 1 or lo == hi else f"{mid} [{lo}, {hi}]")
        clears = {True: "yes", False: "no", None: "-"}[place["clears_next"]]
        lines.append(f"| {place['system']} | {cells['runs']} | " + " | ".join(out)
                     + f" | {clears} |")
    return "\n".join(lines)


def _num(x: float, spec: str) -> str:
    return "not reached" if math.isinf(x) else _fmt(x, spec)


def plot(scenario: str, rows: list[dict[str, Any]], target: float | None, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(9, 3.6), dpi=80, sharey=True)
    any_sent = False
    colors: dict[str, str] = {}  # one colour per system, whatever its seeds
    for row in rows:
        points = row["curve"]
        if not points:
            continue
        first = row["system"] not in colors
        line, = ax_t.plot([p["t"] for p in points], [p["loss"] for p in points], marker=".",
                          color=colors.get(row["system"]), linewidth=1.0,
                          label=row["system"] if first else None)
        colors.setdefault(row["system"], line.get_color())
        sent = [p for p in points if p["bytes"] > 0]  # the log axis has no zero
        any_sent = any_sent or bool(sent)
        ax_b.plot([p["bytes"] / 1e6 for p in sent], [p["loss"] for p in sent], marker=".",
                  color=colors[row["system"]], linewidth=1.0)
    budgets = {row["budget_s"] for row in rows if row.get("budget_s")}
    for budget in budgets:  # the last point: the hosts' models at the end of the budget
        ax_t.axvline(budget, color="grey", linestyle=":", linewidth=0.8)
    for ax in (ax_t, ax_b):
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=0.8)
        ax.grid(alpha=0.3)
    ax_t.set_xlabel("wall clock since start (s); dotted: end of the budget")
    ax_b.set_xlabel("MB sent per host (eth0 tx)")
    if any_sent:
        ax_b.set_xscale("log")
    ax_t.set_ylabel("validation loss (nats/byte)")
    ax_t.legend(fontsize=8)
    fig.suptitle(f"{scenario}" + (f" (dashed: target {target:.3f})" if target else ""))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write(out: Path, results: dict[str, Any]) -> str:
    """Writes results.json, results.md and <scenario>.png under `out`; returns the text."""
    target = results["target"]
    parts = [f"target loss: {_fmt(target)} ({results['target_source']})",
             f"unigram entropy of the training bytes: {_fmt(results.get('unigram_entropy'))}"]
    for kb in sorted({scen["config"].get("held_out_windows", 4096) * 64 / 1024
                      for scen in results["scenarios"].values()}):
        parts.append(END_RULE.format(kb=kb))
    for name, scen in results["scenarios"].items():
        png = out / f"{name}.png"
        try:
            plot(name, scen["rows"], target, png)
            scen["png"] = str(png)
        except Exception as exc:  # the table and JSON still get written
            parts.append(f"\n(plot for {name} failed: {type(exc).__name__}: {exc})")
        parts.append(f"\n### {name}: {scen['description']}\n")
        trainers = scen["config"].get("trainers_per_host", 1)
        if trainers > 1:
            peers = ", ".join(f"{r['system']} {r['peers']}" for r in scen["rows"])
            parts.append(f"{trainers} trainers per host, each with the per-host batch; peers: "
                         f"{peers}; 'in sync s/host' is per trainer.\n")
        if len(scen.get("seeds", [])) > 1:
            parts.append(f"Seeds {', '.join(str(x) for x in scen['seeds'])}, run interleaved; "
                         "each cell the median [lowest, highest] over them:\n")
            parts.append(seeds_table(scen))
            parts.append("")
        for key in ("loss_end", "time_to_ddp_end"):
            text = scen.get("verdicts", {}).get(key, {}).get("text")
            if text:
                parts.append(f"Verdict: {text}.")
        parts.append("\nEvery run:\n")
        parts.append(table(scen["rows"], target))
        parts.append("\nWhere the time went:\n")
        parts.append(time_table(scen["rows"]))
        ddp_end = {r["seed"]: r["ddp_end_loss"] for r in scen["rows"] if "ddp_end_loss" in r}
        if ddp_end:
            ends = ", ".join(f"{loss:.3f}" if len(ddp_end) == 1 else f"seed {seed} {loss:.3f}"
                             for seed, loss in sorted(ddp_end.items()))
            parts.append(f"\nAgainst DDP on this scenario (its curve's final loss: {ends}):\n")
            parts.append(ddp_table(scen["rows"]))
        for row in scen["rows"]:
            agree = row.get("final_models")
            if agree:
                who = "trainers" if row.get("trainers_per_host", 1) > 1 else "hosts"
                parts.append(f"\n{row['system']} (seed {row['seed']}): after its own final "
                             f"sync, the final models of {agree['hosts']} {who} "
                             f"{'agree' if agree['agree'] else 'DIFFER'} "
                             f"(max |diff| {agree['max_abs_diff']:.2e})")
            if row.get("syncs_partial"):
                parts.append(f"\n{row['system']}: {row['syncs_partial']} of {row['syncs_ok']} "
                             "ok syncs were partial (a part's owner missed the round's deadline:"
                             " its elements kept local values)")
            if row.get("local_rounds"):
                parts.append(f"\n{row['system']}: every trainer of its host took part in "
                             f"{row['local_rounds_full']} of {row['local_rounds']} rounds' "
                             "local reduce (per trainer, rounds that succeeded)")
            for message in row["errors"][:3]:
                parts.append(f"\n{row['system']} error: {message}")
    text = "\n".join(parts) + "\n"
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    return text
