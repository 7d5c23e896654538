"""Which systems run on which scenario, with how many seeds, in which order; the named plans
(`--plan rerun`: the whole results rerun) and how long a plan takes.

Runs are interleaved: seed 0 of every system, then seed 1 of every system, and so on, so a
change in the machine's load over the hours spreads over every row instead of landing on one.
A seed sets the data order only; every run starts from the same weights.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from bench.swarm.orchestrator import PEERS_PYTHON
from bench.swarm.scenario import Scenario
from bench.swarm.systems import (
    HIVEMIND_SYSTEMS,
    MULTI_TRAINER_SYSTEMS,
    SINGLE_TRAINER_SYSTEMS,
    SMOKE_SYSTEMS,
)

# Seconds a run takes beyond its budget on this 2-core machine: starting every host's
# processes (torch imports at half a core each, daemons, hivemind's DHT and p2pd), the final
# syncs and exits, the pause between rows. The results rerun (34 runs of 120 s) took 76.6 min
# of runs: 15 s a run beyond its budget; the smoke's short runs take about twice that.
RUN_OVERHEAD_S = 20.0
# Scoring afterwards, in 2 processes: one held-out evaluation of the small model per run and
# its curve's snapshots. The rerun's 34 runs took 4.4 min: 8 s a run.
EVAL_S_PER_RUN = 10.0


@dataclass(frozen=True)
class ScenarioPlan:
    scenario: str
    systems: tuple[str, ...]
    seeds: int = 1

    def runs(self) -> list[tuple[int, str]]:
        """(seed, system) in the order they run: interleaved by seed."""
        return [(seed, system) for seed in range(self.seeds) for system in self.systems]


# The six rows the product's case (wan) is decided on, three seeds each.
WAN_ROWS = ("ddp", "ddp-fp16", "moshpit", "diloco-int4", "hivemind-local", "hivemind-sync")
PLANS: dict[str, tuple[ScenarioPlan, ...]] = {
    "rerun": (ScenarioPlan("wan", WAN_ROWS, 3),
              ScenarioPlan("lan", SINGLE_TRAINER_SYSTEMS, 1),
              ScenarioPlan("churn", SINGLE_TRAINER_SYSTEMS, 1)),
}


def estimate_s(budgets: list[float]) -> float:
    """Machine time of runs that each train for one of `budgets` seconds, scoring included."""
    return sum(b + RUN_OVERHEAD_S + EVAL_S_PER_RUN for b in budgets)


def plan_budgets(plans: tuple[ScenarioPlan, ...] | list[ScenarioPlan], budget_s: float
                 ) -> list[float]:
    """One budget per run of `plans`, each `budget_s`."""
    return [budget_s for p in plans for _ in p.runs()]


def plan_systems(scenarios: list[Scenario], chosen: list[str] | None, smoke: bool,
                 peers_installed: bool | None = None
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
    hivemind = sorted({s for v in plan.values() for s in v if s in HIVEMIND_SYSTEMS})
    installed = PEERS_PYTHON.exists() if peers_installed is None else peers_installed
    if hivemind and not installed:
        reason = f"{PEERS_PYTHON} missing: `make peers` installs hivemind 1.1.12"
        skipped.update({s: reason for s in hivemind})
        plan = {k: [s for s in v if s not in hivemind] for k, v in plan.items()}
    for what, reason in skipped.items():
        print(f"skipping {what}: {reason}", file=sys.stderr)
    return plan, skipped
