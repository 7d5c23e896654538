"""From run records (bench/swarm/orchestrator.py) and the losses of their models
(bench/swarm/evaluation.py) to numbers: curves and the table's columns.

Definitions (also in docs/results.md):
- loss at end: the held-out loss of the mean of the hosts' models at the deadline (the end
  rule, the same for every row; bench/swarm/evaluation.py).
- curve: snapshots are binned by time since start_at (bin = snapshot_every_s); a point is the
  mean validation loss (the 4 KB set) over the hosts that have a snapshot in the bin; the last
  point is the mean over the hosts' models at the deadline.
- bytes: the host's eth0 transmit counter since start_at, mean over hosts (every byte the
  host sent: DHT, matchmaking, gradients, state downloads, hivemind's daemon).
- time to target: first crossing of the curve below the target, interpolated linearly;
  a crossing after the budget shows as '> budget'.
- goodput: surviving samples / budget, over all hosts. A worker that ran to the end keeps its
  last count (DDP workers restart their count from the checkpoint, so rolled-back work is not
  counted); a killed worker keeps what it had at its last successful sync (DDP: at the last
  checkpoint); the rest is lost.
- failures survived: a preemption counts as survived if the other hosts kept training through
  it and the host, once back, trained again.
- cpu busy: cgroup CPU time over the budget / (quota x budget): 100 % means the host was
  compute-bound, less means it waited (network, peers, matchmaking).
- several trainers per host (bench/swarm/layout.py): every trainer's snapshots count in the
  curve's mean, samples are summed over trainers, bytes and CPU stay per host (the trainers
  share its link and cgroup), and seconds in sync are per trainer.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import numpy as np

from bench.swarm.evaluation import curve_events, end_key, end_paths, held_out_key
from bench.swarm.systems import DAEMON_SYSTEMS, DDP_SYSTEMS


def run_seed(record: dict[str, Any]) -> int:
    return int(record.get("seed", record["config"].get("seed", 0)))


def _tx_at(record: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    rows = record["samples"]
    t = np.array([r["t"] for r in rows])
    tx = np.array([r["tx"] for r in rows], dtype=np.float64)
    return t, tx


def bytes_per_host(record: dict[str, Any], at: float) -> float:
    """Mean over hosts of bytes sent from start_at to `at` (absolute time)."""
    t, tx = _tx_at(record)
    start = record["start_at"]
    per_host = [np.interp(at, t, tx[:, i]) - np.interp(start, t, tx[:, i])
                for i in range(tx.shape[1])]
    return float(np.mean(per_host))


def curve(record: dict[str, Any], losses: dict[str, float]) -> list[dict[str, float]]:
    """Validation loss against time: the initial weights at 0, each bin's mean over the hosts'
    snapshots in it, then the mean over the hosts' models at the deadline."""
    every = record["config"]["snapshot_every_s"]
    start = record["start_at"]
    bins: dict[int, list[tuple[float, float]]] = defaultdict(list)
    final: list[tuple[float, float]] = []
    for _, event in curve_events(record):
        loss = losses.get(event["path"], math.nan)
        if not math.isfinite(loss):
            continue
        if event["event"] == "budget":
            final.append((event["t"], loss))
        else:
            bins[round((event["t"] - start) / every)].append((event["t"], loss))
    points = [(float(np.mean([t for t, _ in v])), float(np.mean([x for _, x in v])), len(v))
              for _, v in sorted(bins.items())]
    if final:
        points.append((float(np.mean([t for t, _ in final])),
                       float(np.mean([x for _, x in final])), len(final)))
    out = [{"t": t - start, "loss": loss, "hosts": n, "bytes": bytes_per_host(record, t)}
           for t, loss, n in points]
    first = losses.get(f"initial:{record['config']['model']}")
    if first is not None:
        out.insert(0, {"t": 0.0, "loss": first, "hosts": record["config"]["hosts"],
                       "bytes": 0.0})
    return out


def crossing(points: list[dict[str, float]], target: float) -> float | None:
    """Seconds since start when the curve first reaches `target` (linear between points)."""
    prev = None
    for point in points:
        if point["loss"] <= target:
            if prev is None or prev["loss"] == point["loss"]:
                return point["t"]
            frac = (prev["loss"] - target) / (prev["loss"] - point["loss"])
            return prev["t"] + frac * (point["t"] - prev["t"])
        prev = point
    return None


def loss_at(points: list[dict[str, float]], t: float) -> float:
    """The curve's loss at `t` seconds (linear between points; the rule for the target)."""
    return float(np.interp(t, [p["t"] for p in points], [p["loss"] for p in points]))


def _samples_before(events: list[dict[str, Any]], t: float) -> int:
    return max((int(e["samples"]) for e in events
                if e["event"] in ("progress", "ready") and "samples" in e and e["t"] <= t),
               default=0)


def goodput(record: dict[str, Any]) -> dict[str, float]:
    """Samples that survived into the final models, over the budget (module docstring)."""
    ddp = record["system"] in DDP_SYSTEMS
    checkpoints = sorted(e["t"] for w in record["workers"] for e in w["events"]
                         if e["event"] == "checkpoint")
    processed = surviving = 0
    last_of_host: dict[int, dict[str, Any]] = {}
    for worker in record["workers"]:
        events = worker["events"]
        first = next((int(e["samples"]) for e in events
                      if e["event"] == "ready" and "samples" in e), 0)
        done = next((e for e in events if e["event"] == "done" and "samples" in e), None)
        last = max([int(e["samples"]) for e in events if "samples" in e], default=first)
        processed += max(0, last - first)
        if worker["killed_at"] is None or worker["kill_reason"] == "run over":
            kept = int(done["samples"]) if done else last
        elif ddp:
            kept = _samples_before(events, max([t for t in checkpoints
                                                if t <= worker["killed_at"]], default=0))
        else:
            syncs_ok = [e["t"] for e in events if e["event"] == "sync" and e.get("ok")]
            kept = _samples_before(events, max(syncs_ok, default=0))
        worker["_kept"] = max(kept, first if ddp else 0)
        if ddp:  # a DDP worker's count carries its host's surviving history
            last_of_host[worker["host"]] = worker
        else:
            surviving += max(0, kept - first)
    if ddp:
        surviving = sum(int(w["_kept"]) for w in last_of_host.values())
    budget = record["config"]["budget_s"]
    return {"goodput": surviving / budget, "samples_kept": surviving,
            "samples_processed": processed, "samples_lost": max(0, processed - surviving)}


def failures(record: dict[str, Any]) -> tuple[int, int]:
    """(survived, preemptions)."""
    preempts = [a for a in record["actions"] if a["kind"] == "preempt"]
    survived = 0
    for action in preempts:
        host = action["host"]
        back = next((a["t"] for a in record["actions"]
                     if a["kind"] == "restore" and a["host"] == host and a["t"] > action["t"]),
                    None)
        others = any(e["event"] == "progress" and action["t"] < e["t"] < (back or math.inf)
                     for w in record["workers"] if w["host"] != host for e in w["events"])
        rejoined = back is None or any(
            e["event"] == "progress" and e["t"] > back
            for w in record["workers"] if w["host"] == host for e in w["events"])
        survived += int(others and rejoined)
    return survived, len(preempts)


def syncs(record: dict[str, Any]) -> dict[str, float]:
    """A sync counts as completed when it succeeded with at least one peer (a round that
    found nobody and kept the local values is not one)."""
    every = [e for w in record["workers"] for e in w["events"] if e["event"] == "sync"]
    ok = [e for e in every if e.get("ok") and int(e.get("group_size", 2)) >= 2]
    bad = [e for e in every if not (e.get("ok") and int(e.get("group_size", 2)) >= 2)]
    seconds = [float(e.get("seconds", 0.0)) for e in ok]
    trainers = max(1, record["config"]["hosts"] * record.get("trainers_per_host", 1))
    local = [e for e in every if e.get("ok") and "local_ranks" in e]
    full = [e for e in local if len(e["local_ranks"]) == record.get("trainers_per_host", 1)]
    return {"syncs_ok": len(ok), "syncs_failed": len(bad),
            "syncs_partial": sum(1 for e in ok if e.get("fully_averaged") is False),
            "local_rounds": len(local), "local_rounds_full": len(full),
            "sync_seconds_mean": float(np.mean(seconds)) if seconds else math.nan,
            "sync_seconds_per_host": float(np.sum(seconds)) / trainers,
            "group_size_mean": float(np.mean([e.get("group_size", 0) for e in ok]))
            if ok else math.nan}


def cpu(record: dict[str, Any]) -> dict[str, float]:
    rows = record["samples"]
    cfg = record["config"]
    t = np.array([r["t"] for r in rows])
    used = np.array([r["cpu"] for r in rows], dtype=np.float64)
    throttled = np.array([r["throttled"] for r in rows], dtype=np.float64)
    delayer = np.array([r["delayer_cpu"] for r in rows], dtype=np.float64)
    start, end = record["start_at"], record["end_at"]

    def span(a: np.ndarray) -> np.ndarray:
        return np.array([np.interp(end, t, a[:, i]) - np.interp(start, t, a[:, i])
                         for i in range(a.shape[1])])

    budget = cfg["budget_s"]
    loads = [r["loadavg"] for r in rows if "loadavg" in r and start <= r["t"] <= end]
    return {"loadavg_mean": float(np.mean(loads)) if loads else math.nan,
            "loadavg_max": float(np.max(loads)) if loads else math.nan,
            "cpu_busy": float(np.mean(span(used))) / (cfg["cpu_cores"] * budget),
            "throttled_s": float(np.mean(span(throttled))),
            "delayer_cpu_s": float(np.sum(span(delayer)))}


def max_abs_diff(paths: list[str]) -> dict[str, Any]:
    """Max |difference| between the models in `paths`, parameter by parameter."""
    import torch
    if len(paths) < 2:
        return {"hosts": len(paths), "max_abs_diff": math.nan, "agree": False}
    states = [torch.load(p, map_location="cpu", weights_only=True) for p in paths]
    diff = 0.0
    for name, ref in states[0].items():
        if not torch.is_floating_point(ref):
            continue
        for other in states[1:]:
            diff = max(diff, float((other[name].float() - ref.float()).abs().max()))
    return {"hosts": len(paths), "max_abs_diff": diff, "agree": diff <= 1e-5}


def models_agree(record: dict[str, Any]) -> dict[str, Any]:
    """How far apart the hosts' final (`done`) models are, after a system's own final sync."""
    return max_abs_diff([e["path"] for w in record["workers"] if w["killed_at"] is None
                         for e in w["events"] if e["event"] == "done" and e.get("path")])


def summarize(record: dict[str, Any], losses: dict[str, float], target: float | None
              ) -> dict[str, Any]:
    points = curve(record, losses)
    budget = record["config"]["budget_s"]
    row: dict[str, Any] = {"scenario": record["scenario"], "system": record["system"],
                           "seed": run_seed(record),
                           "budget_s": budget, "curve": points,
                           "trainers_per_host": record.get("trainers_per_host", 1),
                           "peers": record.get("peers", record["config"]["hosts"])}
    # the end rule (bench/swarm/evaluation.py): the mean of the hosts' models at the deadline
    # on the held-out set, for every row
    ends = end_paths(record)
    windows = int(record["config"].get("held_out_windows", 4096))
    row["loss_end"] = losses.get(end_key(record), math.nan)
    row["loss_start"] = losses.get(held_out_key(record["config"]["model"], windows), math.nan)
    row["end_models"] = len(ends)
    row["held_out_windows"] = windows
    late = [float(e.get("late_s", 0.0)) for w in record["workers"] for e in w["events"]
            if e["event"] == "budget"]
    row["late_s_max"] = max(late) if late else math.nan
    row["end_spread"] = (0.0 if record["system"] in DDP_SYSTEMS
                         else max_abs_diff(ends)["max_abs_diff"])
    reached = crossing(points, target) if target is not None and points else None
    row["time_to_target"] = reached if reached is not None and reached <= budget else None
    row["bytes_to_target"] = (bytes_per_host(record, record["start_at"] + reached)
                              if row["time_to_target"] is not None and reached is not None
                              else None)
    row["bytes_total"] = bytes_per_host(record, record["end_at"])
    row.update(goodput(record))
    row["failures_survived"], row["preemptions"] = failures(record)
    row.update(syncs(record))
    row.update(cpu(record))
    # A worker that was replaced (killed, or failed when a peer was preempted, then
    # restarted by the orchestrator: a DDP generation) failed as expected; its errors are
    # counted, not reported as the run's.
    last_gen = {w["host"]: max(x["gen"] for x in record["workers"] if x["host"] == w["host"])
                for w in record["workers"]}
    errors = [(w["gen"] < last_gen[w["host"]], f"host {w['host']}: {e.get('message', '')}")
              for w in record["workers"] for e in w["events"] if e["event"] == "error"]
    row["errors"] = [m for replaced, m in errors if not replaced]
    row["errors_of_replaced_workers"] = sum(1 for replaced, _ in errors if replaced)
    if record["system"] in DAEMON_SYSTEMS:
        row["final_models"] = models_agree(record)
    return row


def against_ddp(records: list[dict[str, Any]], rows: dict[int, dict[str, Any]]) -> None:
    """Adds to each row (keyed by id of its record) its bytes sent per sample processed and,
    where DDP ran on the same scenario with the same seed, when and after how many bytes per
    host its curve first reached the loss DDP's curve ended at: the yardstick on scenarios
    where no system reaches the target within the budget."""
    ddp = {(r["scenario"], run_seed(r)): rows[id(r)] for r in records if r["system"] == "ddp"}
    for record in records:
        row = rows[id(record)]
        hosts = record["config"]["hosts"]
        row["bytes_per_sample"] = (row["bytes_total"] * hosts / row["samples_processed"]
                                   if row["samples_processed"] else math.nan)
        base = ddp.get((record["scenario"], run_seed(record)))
        if base is None or not base["curve"] or not math.isfinite(base["curve"][-1]["loss"]):
            continue
        # on the curves' scale: DDP's model at the deadline on the validation windows
        reached = crossing(row["curve"], base["curve"][-1]["loss"])
        row["ddp_end_loss"] = base["curve"][-1]["loss"]
        row["time_to_ddp_end"] = reached
        row["bytes_to_ddp_end"] = (None if reached is None
                                   else bytes_per_host(record, record["start_at"] + reached))
