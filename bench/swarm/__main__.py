"""`python -m bench.swarm`: every system trains the same model on the same emulated network,
one scenario after another, each with one or more seeds (the data order); then every saved
model is scored and the tables, plots and JSON are written. Needs root (network namespaces,
tc, nftables, cgroups) and, for the hivemind rows, `make peers` (.venv-peers).

    python -m bench.swarm                        # lan, wan, churn; all systems; one seed
    python -m bench.swarm --scenario wan --systems moshpit,ddp --budget 60 --seeds 3
    python -m bench.swarm --plan rerun --budget 120 --snapshot-every 12
                                                 # the results rerun (docs/results.md)
    python -m bench.swarm --smoke                # 4 hosts, tiny model, ~12 s per system
    python -m bench.swarm --scenario multi --budget 120   # 2 trainers per host: moshpit-local
                                                          # against moshpit-each
    python -m bench.swarm --scenario wan --systems hivemind-sync \\
        --knob hivemind-sync.epoch_steps=1       # a system's knob, by name
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
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.swarm import evaluation, report
from bench.swarm.orchestrator import SYSTEMS, RunConfig, SystemRun
from bench.swarm.plan import PLANS, ScenarioPlan, estimate_s, plan_systems
from bench.swarm.scenario import DEFAULT_SCENARIOS, Scenario, ScenarioError, load
from bench.swarm.summary import TARGET_RULE, summarize
from bench.swarm.systems import MULTI_TRAINER_SYSTEMS, SINGLE_TRAINER_SYSTEMS, SMOKE_SYSTEMS
from bench.swarm.systems.hivemind_settings import SMOKE_KNOBS
from netlab import Topology, missing_prerequisites

SMOKE_HELD_OUT_WINDOWS = 512  # 32 KB: the smoke pays for its evaluation in seconds


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from bench.swarm.workload import DEFAULT_HYPER, HELD_OUT_WINDOWS

    p = argparse.ArgumentParser(prog="python -m bench.swarm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", action="append", metavar="FILE",
                   help="scenario TOML file or name under bench/scenarios (repeatable; "
                        f"default: {', '.join(DEFAULT_SCENARIOS)}; --smoke: lan)")
    p.add_argument("--plan", choices=sorted(PLANS),
                   help="a named plan of scenarios, systems and seeds instead of --scenario, "
                        "--systems and --seeds (rerun: wan with 3 seeds of "
                        + ", ".join(PLANS["rerun"][0].systems) + "; lan and churn once with "
                        "every system)")
    p.add_argument("--seeds", type=int, default=1,
                   help="runs of every system per scenario, each with its own data order "
                        "(seed 0, 1, ...), interleaved: seed 0 of every system first (default 1)")
    p.add_argument("--hosts", type=int, help="hosts (default: the scenario's, 4)")
    p.add_argument("--budget", type=float, help="seconds of training per system (default: "
                   "the scenario's; --smoke: 12)")
    p.add_argument("--systems", help=f"comma-separated, from {', '.join(SYSTEMS)} (default: "
                   f"{', '.join(SINGLE_TRAINER_SYSTEMS)}; --smoke: {', '.join(SMOKE_SYSTEMS)}; "
                   "a scenario with several trainers per host runs only "
                   f"{', '.join(MULTI_TRAINER_SYSTEMS)})")
    p.add_argument("--knob", action="append", default=[], metavar="SYSTEM.NAME=VALUE",
                   help="override a system's knob (see its module in bench/swarm/systems); "
                        "VALUE is read as JSON, else as a string (repeatable)")
    p.add_argument("--target", type=float,  # argparse %-formats help: escape the rule's %
                   help="target loss (default: " + TARGET_RULE.replace("%", "%%") + ")")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    p.add_argument("--out", type=Path, help="output directory (default: a new one in /tmp)")
    p.add_argument("--smoke", action="store_true",
                   help="4 hosts, tiny model, 12 s per system, lan, the hivemind rows with "
                        "periods sized to it, a 32 KB held-out set (what `make test` runs)")
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
    p.add_argument("--held-out-windows", type=int,
                   help=f"windows of 64 bytes the end models are scored on (default "
                        f"{HELD_OUT_WINDOWS}, 256 KB; --smoke {SMOKE_HELD_OUT_WINDOWS})")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: evaluate and report the run.json files already in --out")
    p.add_argument("--eval-procs", type=int,
                   help="processes evaluating snapshots after the runs (default 2; --smoke 1)")
    args = p.parse_args(argv)
    if args.plan and (args.scenario or args.systems or args.seeds != 1 or args.smoke):
        p.error("--plan names its own scenarios, systems and seeds: leave out --scenario, "
                "--systems, --seeds and --smoke")
    if args.seeds < 1:
        p.error("--seeds must be at least 1")
    return args


def parse_knobs(items: list[str], smoke: bool) -> dict[str, dict[str, Any]]:
    """SYSTEM.NAME=VALUE items (VALUE as JSON, else a string) over the smoke's own knobs."""
    knobs: dict[str, dict[str, Any]] = {s: dict(k) for s, k in SMOKE_KNOBS.items()} \
        if smoke else {}
    for item in items:
        name, sep, raw = item.partition("=")
        system, dot, knob = name.partition(".")
        if not sep or not dot or system not in SYSTEMS or not knob:
            raise ValueError(f"--knob {item!r}: want SYSTEM.NAME=VALUE with SYSTEM one of "
                             f"{', '.join(SYSTEMS)}")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        knobs.setdefault(system, {})[knob] = value
    return knobs


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds the topologies: namespaces and cgroups go too


def scenario_plans(args: argparse.Namespace, chosen: list[str] | None
                   ) -> tuple[list[Scenario], list[ScenarioPlan], dict[str, str]]:
    """The scenarios and, for each, the systems and seeds that run (ScenarioError if a
    scenario file is bad)."""
    if args.plan:
        named = PLANS[args.plan]
        scenarios = [load(p.scenario) for p in named]
        skipped: dict[str, str] = {}
        plans = []
        for scenario, p in zip(scenarios, named, strict=True):
            systems, why = plan_systems([scenario], list(p.systems), smoke=False)
            skipped.update(why)
            plans.append(ScenarioPlan(scenario.name, tuple(systems[scenario.name]), p.seeds))
        return scenarios, plans, skipped
    names = args.scenario or (["lan"] if args.smoke else list(DEFAULT_SCENARIOS))
    scenarios = [load(n) for n in names]
    systems, skipped = plan_systems(scenarios, chosen, args.smoke)
    return scenarios, [ScenarioPlan(s.name, tuple(systems[s.name]), args.seeds)
                       for s in scenarios], skipped


def main(argv: list[str] | None = None) -> int:
    began = time.time()
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    chosen = None if args.systems is None else [
        s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in chosen or [] if s not in SYSTEMS]
    if unknown:
        print(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}", file=sys.stderr)
        return 2
    try:
        knobs = parse_knobs(args.knob, args.smoke)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    problem = None if args.report_only else missing_prerequisites(need_cgroup=True)
    if problem:
        print(f"cannot run the benchmark: {problem}", file=sys.stderr)
        return 2
    try:
        scenarios, plans, skipped = scenario_plans(args, chosen)
    except ScenarioError as exc:
        print(f"bad scenario: {exc}", file=sys.stderr)
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="moshpit-swarm-"))
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m bench.swarm " + shlex.join(argv if argv is not None else sys.argv[1:])
    say(f"results in {out}")

    records: list[dict[str, Any]] = []
    configs = {s.name: config_for(s, args, out, knobs) for s in scenarios}
    failed: dict[str, str] = {}
    if args.report_only:
        if args.out is None:
            print("--report-only needs --out (a directory of an earlier run)", file=sys.stderr)
            return 2
        records, configs = load_records(out, scenarios, plans)
        scenarios = [s for s in scenarios if s.name in configs]
    else:
        budgets = [configs[p.scenario].budget_s for p in plans for _ in p.runs()]
        say(f"{len(budgets)} runs; expected machine time about {estimate_s(budgets) / 60:.0f} "
            "min")
    for scenario, p in [] if args.report_only else zip(scenarios, plans, strict=True):
        base = configs[scenario.name]
        try:
            scenario.check_hosts(base.hosts)
        except ScenarioError as exc:
            print(f"bad scenario: {exc}", file=sys.stderr)
            return 2
        with Topology(base.hosts, out / scenario.name / "net",
                      links=scenario.links_for(base.hosts), cpu_cores=base.cpu_cores) as topo:
            for seed, system in p.runs():
                cfg = replace(base, seed=seed)
                name = f"{scenario.name}/{system}/seed{seed}"
                say(f"[{name}] {cfg.hosts} hosts x {cfg.trainers_per_host} trainers, "
                    f"{cfg.budget_s:g} s, model {cfg.model}, {cfg.cpu_cores:g} cores per host")
                run = SystemRun(topo, scenario, system, cfg,
                                functools.partial(say_as, f"[{name}]"))
                try:
                    records.append(run.run())
                except Exception as exc:  # one system failing must not hide the others
                    failed[name] = f"{type(exc).__name__}: {exc}"
                    say(f"[{name}] failed: {exc}\n{traceback.format_exc()}")
    runs_s = time.time() - began
    eval_procs = args.eval_procs or (1 if args.smoke else 2)
    say(f"evaluating ({eval_procs} processes)")
    t0 = time.time()
    losses = evaluation.evaluate_runs(records, procs=eval_procs)
    eval_s = time.time() - t0
    say(f"evaluated {len(losses)} models and snapshots in {eval_s:.0f} s")
    results = summarize(records, losses, scenarios, configs, args.target)
    total_s = time.time() - began
    results.update({"command": command, "skipped": skipped, "failed": failed,
                    "machine_s": {"runs": runs_s, "evaluation": eval_s, "total": total_s}})
    text = report.write(out, results)
    print(text, file=sys.stderr)
    say(f"table: {out / 'results.md'}; plots: {out}/<scenario>.png; json: {out / 'results.json'}")
    say(f"total machine time {total_s / 60:.1f} min ({len(records)} runs {runs_s / 60:.1f} min, "
        f"evaluation {eval_s / 60:.1f} min)")
    if args.json:
        print(json.dumps(results, default=str))
    return 1 if failed else 0


def load_records(out: Path, scenarios: list[Scenario], plans: list[ScenarioPlan]
                 ) -> tuple[list[dict[str, Any]], dict[str, RunConfig]]:
    """Every run.json of the plan's scenarios and systems under `out`, whatever its seed."""
    records, configs = [], {}
    for scenario, p in zip(scenarios, plans, strict=True):
        for system in p.systems:
            for path in sorted((out / scenario.name / system).glob("seed*/run.json")):
                record = json.loads(path.read_text())
                records.append(record)
                raw = dict(record["config"], out=Path(record["config"]["out"]), seed=0)
                configs[scenario.name] = RunConfig(**raw)
    return records, configs


def config_for(scenario: Scenario, args: argparse.Namespace, out: Path,
               knobs: dict[str, dict[str, Any]]) -> RunConfig:
    """The scenario's settings for seed 0 (each run replaces the seed)."""
    from bench.swarm.workload import HELD_OUT_WINDOWS

    hosts = args.hosts or (4 if args.smoke else scenario.hosts)
    budget = args.budget or (12.0 if args.smoke else scenario.budget_s)
    cores = args.cores or (os.cpu_count() or 1) / hosts
    snapshot = args.snapshot_every or max(5.0, budget / 15)
    held_out = args.held_out_windows or (SMOKE_HELD_OUT_WINDOWS if args.smoke
                                         else HELD_OUT_WINDOWS)
    return RunConfig(
        hosts=hosts, budget_s=budget, out=out, model=args.model or
        ("tiny" if args.smoke else "small"), batch=args.batch, seq_len=args.seq_len,
        lr=args.lr, weight_decay=args.weight_decay, snapshot_every_s=snapshot,
        checkpoint_every_s=max(10.0, budget / 5), cpu_cores=cores,
        startup_s=args.startup, trainers_per_host=scenario.trainers_per_host,
        final_grace_s=max(30.0, budget / 3), held_out_windows=held_out,
        knobs=knobs)


def say_as(prefix: str, message: str) -> None:
    say(f"{prefix} {message}")


def say(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
