"""`python -m bench.swarm`: every system trains the same model on the same emulated network,
one scenario after another; then every snapshot is evaluated and the table, plots and JSON are
written. Needs root (network namespaces, tc, nftables, cgroups) and, for the hivemind rows,
`make peers` (.venv-peers).

    python -m bench.swarm                        # lan, wan, churn; all systems
    python -m bench.swarm --scenario wan --systems moshpit,ddp --budget 60
    python -m bench.swarm --smoke                # 4 hosts, tiny model, ~12 s per system
    python -m bench.swarm --scenario multi --budget 120   # 2 trainers per host: moshpit-local
                                                          # against moshpit-each
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from bench.swarm import metrics, report
from bench.swarm.orchestrator import PEERS_PYTHON, SYSTEMS, RunConfig, SystemRun
from bench.swarm.scenario import DEFAULT_SCENARIOS, Scenario, ScenarioError, load
from bench.swarm.systems import MULTI_TRAINER_SYSTEMS, SINGLE_TRAINER_SYSTEMS, SMOKE_SYSTEMS
from netlab import Topology, missing_prerequisites


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from bench.swarm.workload import DEFAULT_HYPER

    p = argparse.ArgumentParser(prog="python -m bench.swarm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", action="append", metavar="FILE",
                   help="scenario TOML file or name under bench/scenarios (repeatable; "
                        f"default: {', '.join(DEFAULT_SCENARIOS)}; --smoke: lan)")
    p.add_argument("--hosts", type=int, help="hosts (default: the scenario's, 4)")
    p.add_argument("--budget", type=float, help="seconds of training per system (default: "
                   "the scenario's; --smoke: 12)")
    p.add_argument("--systems", help=f"comma-separated, from {', '.join(SYSTEMS)} (default: "
                   f"{', '.join(SINGLE_TRAINER_SYSTEMS)}; --smoke: {', '.join(SMOKE_SYSTEMS)}; "
                   "a scenario with several trainers per host runs only "
                   f"{', '.join(MULTI_TRAINER_SYSTEMS)})")
    p.add_argument("--target", type=float,  # argparse %-formats help: escape the rule's %
                   help="target loss (default: " + report.TARGET_RULE.replace("%", "%%") + ")")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    p.add_argument("--out", type=Path, help="output directory (default: a new one in /tmp)")
    p.add_argument("--smoke", action="store_true",
                   help="4 hosts, tiny model, 12 s per system, lan (what `make test` runs)")
    p.add_argument("--model", help="workload preset (default small; --smoke: tiny)")
    p.add_argument("--batch", type=int, default=DEFAULT_HYPER.batch, help="sequences per step "
                   "per host")
    p.add_argument("--seq-len", type=int, default=DEFAULT_HYPER.seq_len)
    p.add_argument("--lr", type=float, default=DEFAULT_HYPER.lr)
    p.add_argument("--weight-decay", type=float, default=DEFAULT_HYPER.weight_decay)
    p.add_argument("--cores", type=float,
                   help="CPU quota per host (default: this machine's cores / hosts)")
    p.add_argument("--startup", type=float, default=240.0,
                   help="most seconds from launch until every host is ready; they then start "
                        "together (startup is not timed; default 240)")
    p.add_argument("--snapshot-every", type=float,
                   help="seconds between snapshots (default budget/15, at least 5)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: evaluate and report the run.json files already in --out")
    p.add_argument("--eval-procs", type=int,
                   help="processes evaluating snapshots after the runs (default 2; --smoke 1)")
    return p.parse_args(argv)


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds the topologies: namespaces and cgroups go too


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    chosen = None if args.systems is None else [
        s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in chosen or [] if s not in SYSTEMS]
    if unknown:
        print(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}", file=sys.stderr)
        return 2
    problem = None if args.report_only else missing_prerequisites(need_cgroup=True)
    if problem:
        print(f"cannot run the benchmark: {problem}", file=sys.stderr)
        return 2
    names = args.scenario or (["lan"] if args.smoke else list(DEFAULT_SCENARIOS))
    try:
        scenarios = [load(n) for n in names]
    except ScenarioError as exc:
        print(f"bad scenario: {exc}", file=sys.stderr)
        return 2
    plan, skipped = plan_systems(scenarios, chosen, args.smoke)
    out = args.out or Path(tempfile.mkdtemp(prefix="moshpit-swarm-"))
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.swarm " + shlex.join(argv if argv is not None else sys.argv[1:])
    say(f"results in {out}")

    records: list[dict[str, Any]] = []
    configs: dict[str, RunConfig] = {}
    failed: dict[str, str] = {}
    if args.report_only:
        if args.out is None:
            print("--report-only needs --out (a directory of an earlier run)", file=sys.stderr)
            return 2
        records, configs = load_records(out, scenarios, plan)
        scenarios = [s for s in scenarios if s.name in configs]
    for scenario in [] if args.report_only else scenarios:
        cfg = config_for(scenario, args, out)
        configs[scenario.name] = cfg
        try:
            scenario.check_hosts(cfg.hosts)
        except ScenarioError as exc:
            print(f"bad scenario: {exc}", file=sys.stderr)
            return 2
        with Topology(cfg.hosts, out / scenario.name / "net", links=scenario.links_for(cfg.hosts),
                      cpu_cores=cfg.cpu_cores) as topo:
            for system in plan[scenario.name]:
                say(f"[{scenario.name}/{system}] {cfg.hosts} hosts x {cfg.trainers_per_host} "
                    f"trainers, {cfg.budget_s:g} s, model {cfg.model}, {cfg.cpu_cores:g} cores "
                    "per host")
                run = SystemRun(topo, scenario, system, cfg,
                                functools.partial(say_as, f"[{scenario.name}/{system}]"))
                try:
                    records.append(run.run())
                except Exception as exc:  # one system failing must not hide the others
                    failed[f"{scenario.name}/{system}"] = f"{type(exc).__name__}: {exc}"
                    say(f"[{scenario.name}/{system}] failed: {exc}\n{traceback.format_exc()}")

    eval_procs = args.eval_procs or (1 if args.smoke else 2)
    say(f"evaluating snapshots ({eval_procs} processes)")
    t0 = time.time()
    losses = metrics.evaluate_snapshots(records, procs=eval_procs)
    for model, seed in {(c.model, c.seed) for c in configs.values()}:
        losses[f"initial:{model}:{seed}"] = metrics.initial_loss(model, seed)
    say(f"evaluated {len(losses)} snapshots in {time.time() - t0:.0f} s")
    results = summarize(records, losses, scenarios, args, configs)
    results.update({"command": command, "skipped": skipped, "failed": failed})
    text = report.write(out, results)
    print(text, file=sys.stderr)
    say(f"table: {out / 'results.md'}; plots: {out}/<scenario>.png; json: {out / 'results.json'}")
    if args.json:
        print(json.dumps(results, default=str))
    return 1 if failed else 0


def plan_systems(scenarios: list[Scenario], chosen: list[str] | None, smoke: bool
                 ) -> tuple[dict[str, list[str]], dict[str, str]]:
    """The systems each scenario runs, and why the others asked for do not (keyed by system,
    or scenario/system where only that scenario cannot run it)."""
    plan: dict[str, list[str]] = {}
    skipped: dict[str, str] = {}
    for scenario in scenarios:
        multi = scenario.trainers_per_host > 1
        default = MULTI_TRAINER_SYSTEMS if multi else (SMOKE_SYSTEMS if smoke else
                                                       SINGLE_TRAINER_SYSTEMS)
        systems = list(default if chosen is None else chosen)
        if multi:
            for system in [s for s in systems if s not in MULTI_TRAINER_SYSTEMS]:
                skipped[f"{scenario.name}/{system}"] = (
                    f"runs one trainer per host; {scenario.name} has "
                    f"{scenario.trainers_per_host} (only {', '.join(MULTI_TRAINER_SYSTEMS)})")
                systems.remove(system)
        plan[scenario.name] = systems
    hivemind = sorted({s for v in plan.values() for s in v if s.startswith("hivemind")})
    if hivemind and not PEERS_PYTHON.exists():
        reason = f"{PEERS_PYTHON} missing: `make peers` installs hivemind 1.1.12"
        skipped.update({s: reason for s in hivemind})
        plan = {k: [s for s in v if s not in hivemind] for k, v in plan.items()}
    for what, reason in skipped.items():
        print(f"skipping {what}: {reason}", file=sys.stderr)
    return plan, skipped


def load_records(out: Path, scenarios: list[Scenario], plan: dict[str, list[str]]
                 ) -> tuple[list[dict[str, Any]], dict[str, RunConfig]]:
    records, configs = [], {}
    for scenario in scenarios:
        for system in plan[scenario.name]:
            path = out / scenario.name / system / "run.json"
            if path.exists():
                record = json.loads(path.read_text())
                records.append(record)
                raw = dict(record["config"], out=Path(record["config"]["out"]))
                configs[scenario.name] = RunConfig(**raw)
    return records, configs


def config_for(scenario: Scenario, args: argparse.Namespace, out: Path) -> RunConfig:
    hosts = args.hosts or (4 if args.smoke else scenario.hosts)
    budget = args.budget or (12.0 if args.smoke else scenario.budget_s)
    cores = args.cores or (os.cpu_count() or 1) / hosts
    snapshot = args.snapshot_every or max(5.0, budget / 15)
    return RunConfig(
        hosts=hosts, budget_s=budget, out=out, model=args.model or
        ("tiny" if args.smoke else "small"), batch=args.batch, seq_len=args.seq_len,
        lr=args.lr, weight_decay=args.weight_decay, snapshot_every_s=snapshot,
        checkpoint_every_s=max(10.0, budget / 5), cpu_cores=cores,
        startup_s=args.startup, trainers_per_host=scenario.trainers_per_host,
        final_grace_s=max(30.0, budget / 3))


def summarize(records: list[dict[str, Any]], losses: dict[str, float],
              scenarios: list[Scenario], args: argparse.Namespace,
              configs: dict[str, RunConfig]) -> dict[str, Any]:
    rows = {id(r): metrics.summarize(r, losses, None) for r in records}
    target, source = args.target, "--target"
    if target is None:
        source = "no target: DDP on lan was not run and --target was not given"
        for r in records:
            curve = rows[id(r)]["curve"]
            if r["scenario"] == "lan" and r["system"] == "ddp" and curve:
                target = metrics.loss_at(curve, 0.8 * r["config"]["budget_s"])
                source = "DDP on lan at 80 % of its budget"
    if target is None:
        worst = [metrics.loss_at(rows[id(r)]["curve"], 0.8 * r["config"]["budget_s"])
                 for r in records if rows[id(r)]["curve"]]
        if worst:
            target = max(worst)
            source = "no DDP on lan: the highest loss a row's curve had at 80 % of its budget"
    if target is not None:
        rows = {id(r): metrics.summarize(r, losses, target) for r in records}
    metrics.against_ddp(records, rows)
    entropy = None
    try:
        from bench.swarm.workload import train_entropy
        entropy = train_entropy()
    except Exception as exc:  # the table still stands without it
        say(f"unigram entropy unavailable: {exc}")
    return {"target": target, "target_source": source, "target_rule": report.TARGET_RULE,
            "unigram_entropy": entropy,
            "scenarios": {s.name: {"description": s.description,
                                   "config": configs[s.name].to_json(),
                                   "links": [vars(link) for link in
                                             s.links_for(configs[s.name].hosts)],
                                   "events": [vars(e) for e in s.events],
                                   "rows": [rows[id(r)] for r in records
                                            if r["scenario"] == s.name]}
                          for s in scenarios}}


def say_as(prefix: str, message: str) -> None:
    say(f"{prefix} {message}")


def say(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
