"""The results: a markdown table per scenario, a PNG per scenario (validation loss against
wall clock and against bytes sent per host), and JSON for machines."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

TARGET_RULE = ("the validation loss the DDP run of the `lan` scenario reaches at 80 % of its "
               "budget (linear between evaluated snapshots), unless --target overrides it; "
               "without either, the highest loss any row's curve had at 80 % of its budget")


def _fmt_bytes(n: float | None) -> str:
    if n is None or not math.isfinite(n):
        return "-"
    return f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


def table(rows: list[dict[str, Any]], target: float | None) -> str:
    head = ("| system | time to target | bytes/host to target | loss at end | goodput (samples/s) "
            "| failures survived | syncs ok/all (mean s) | CPU busy | sent/host |")
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
        end = _fmt(row["loss_end"]) + ("" if row["loss_end_from_done"] else " (no done)")
        lines.append(
            f"| {row['system']} | {ttt} | {_fmt_bytes(row['bytes_to_target'])} | {end} "
            f"| {_fmt(row['goodput'], '.1f')} | {fails} "
            f"| {row['syncs_ok']}/{syncs} ({_fmt(row['sync_seconds_mean'], '.2f')}) "
            f"| {_fmt(100 * row['cpu_busy'], '.0f')} % | {_fmt_bytes(row['bytes_total'])} |")
    return "\n".join(lines)


def time_table(rows: list[dict[str, Any]]) -> str:
    """Where the time went: compute (the quota used), time inside sync calls, bytes."""
    head = ("| system | CPU busy (of quota) | throttled s/host | in sync s/host | sent MB/s/host "
            "| samples processed | samples lost | delayer CPU s | machine load (mean/max) |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for row in rows:
        budget = row.get("budget_s") or math.nan
        lines.append(
            f"| {row['system']} | {_fmt(100 * row['cpu_busy'], '.0f')} % "
            f"| {_fmt(row['throttled_s'], '.1f')} | {_fmt(row['sync_seconds_per_host'], '.1f')} "
            f"| {_fmt(row['bytes_total'] / 1e6 / budget, '.2f')} | {row['samples_processed']} "
            f"| {row['samples_lost']} | {_fmt(row['delayer_cpu_s'], '.1f')} "
            f"| {_fmt(row.get('loadavg_mean'), '.1f')}/{_fmt(row.get('loadavg_max'), '.1f')} |")
    return "\n".join(lines)


def ddp_table(rows: list[dict[str, Any]]) -> str:
    """Against DDP on the same scenario: the time and bytes to DDP's final loss, and bytes
    per sample (DDP's over each row's: how many times fewer bytes a sample cost)."""
    base = next((r for r in rows if r["system"] == "ddp"), None)
    head = ("| system | time to DDP's final loss | bytes/host to it | bytes per sample "
            "| DDP's bytes per sample / this row's |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for row in rows:
        reached = row.get("time_to_ddp_end")
        ratio = (base["bytes_per_sample"] / row["bytes_per_sample"]
                 if base and row["bytes_per_sample"] else math.nan)
        lines.append(
            f"| {row['system']} | {'-' if reached is None else f'{reached:.0f} s'} "
            f"| {_fmt_bytes(row.get('bytes_to_ddp_end'))} "
            f"| {_fmt(row['bytes_per_sample'] / 1e3, '.1f')} kB | {_fmt(ratio, '.0f')}x |")
    return "\n".join(lines)


def plot(scenario: str, rows: list[dict[str, Any]], target: float | None, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(9, 3.6), dpi=80, sharey=True)
    any_sent = False
    for row in rows:
        points = row["curve"]
        if not points:
            continue
        line, = ax_t.plot([p["t"] for p in points], [p["loss"] for p in points], marker=".",
                          label=row["system"])
        sent = [p for p in points if p["bytes"] > 0]  # the log axis has no zero
        any_sent = any_sent or bool(sent)
        ax_b.plot([p["bytes"] / 1e6 for p in sent], [p["loss"] for p in sent], marker=".",
                  color=line.get_color(), label=row["system"])
    budgets = {row["budget_s"] for row in rows if row.get("budget_s")}
    for budget in budgets:  # points after it: final syncs and `done`
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
        parts.append(table(scen["rows"], target))
        parts.append("\nWhere the time went:\n")
        parts.append(time_table(scen["rows"]))
        ddp_end = next((r["ddp_end_loss"] for r in scen["rows"] if "ddp_end_loss" in r), None)
        if ddp_end is not None:
            parts.append(f"\nAgainst DDP on this scenario (its final loss: {ddp_end:.3f}):\n")
            parts.append(ddp_table(scen["rows"]))
        for row in scen["rows"]:
            agree = row.get("final_models")
            if agree:
                who = "trainers" if row.get("trainers_per_host", 1) > 1 else "hosts"
                parts.append(f"\n{row['system']}: final models of {agree['hosts']} {who} "
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
