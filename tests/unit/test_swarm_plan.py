"""bench.swarm's plans: the rerun's scenarios, systems and seeds, runs interleaved by seed, the
time it is expected to take, and the command line that names them."""

from __future__ import annotations

import pytest

from bench.swarm.__main__ import parse_args, parse_knobs
from bench.swarm.plan import (
    EVAL_S_PER_RUN,
    PLANS,
    RUN_OVERHEAD_S,
    ScenarioPlan,
    estimate_s,
    plan_budgets,
    plan_systems,
)
from bench.swarm.scenario import load
from bench.swarm.systems import HIVEMIND_SYSTEMS, SINGLE_TRAINER_SYSTEMS
from bench.swarm.systems.hivemind_settings import SMOKE_KNOBS


def test_the_rerun_is_wan_three_seeds_of_six_rows_then_lan_and_churn_once_with_all() -> None:
    wan, lan, churn = PLANS["rerun"]
    assert (wan.scenario, wan.seeds) == ("wan", 3)
    assert set(wan.systems) == {"ddp", "ddp-fp16", "moshpit", "diloco-int4", "hivemind-local",
                                "hivemind-sync"}
    for p, name in ((lan, "lan"), (churn, "churn")):
        assert (p.scenario, p.seeds, p.systems) == (name, 1, SINGLE_TRAINER_SYSTEMS)
    assert "ddp-fp16" in SINGLE_TRAINER_SYSTEMS
    assert sum(len(p.runs()) for p in PLANS["rerun"]) == 18 + 2 * len(SINGLE_TRAINER_SYSTEMS)


def test_runs_are_interleaved_by_seed() -> None:
    runs = ScenarioPlan("wan", ("ddp", "moshpit"), 3).runs()
    assert runs == [(0, "ddp"), (0, "moshpit"), (1, "ddp"), (1, "moshpit"), (2, "ddp"),
                    (2, "moshpit")]


def test_estimate_counts_every_run_with_its_overhead_and_scoring() -> None:
    budgets = plan_budgets(PLANS["rerun"], 120.0)
    assert len(budgets) == 34 and set(budgets) == {120.0}
    assert estimate_s(budgets) == 34 * (120.0 + RUN_OVERHEAD_S + EVAL_S_PER_RUN)


def test_hivemind_rows_are_skipped_without_their_venv() -> None:
    plan, skipped = plan_systems([load("wan")], list(PLANS["rerun"][0].systems), smoke=False,
                                 peers_installed=False)
    assert set(skipped) == set(HIVEMIND_SYSTEMS)
    assert plan["wan"] == ["ddp", "ddp-fp16", "moshpit", "diloco-int4"]


def test_knobs_from_the_command_line_over_the_smokes() -> None:
    assert parse_knobs([], smoke=False) == {}
    smoke = parse_knobs(["hivemind-sync.epoch_steps=1", "moshpit.codec=fp16",
                         "hivemind-local.fp16=false"], smoke=True)
    assert smoke["hivemind-sync"] == {**SMOKE_KNOBS["hivemind-sync"], "epoch_steps": 1}
    assert smoke["moshpit"] == {"codec": "fp16"} and smoke["hivemind-local"]["fp16"] is False
    for bad in ("hivemind-sync=1", "gossip.x=1", "ddp.timeout_s"):
        with pytest.raises(ValueError, match=r"SYSTEM\.NAME=VALUE"):
            parse_knobs([bad], smoke=False)


def test_a_plan_names_its_own_scenarios_systems_and_seeds(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_args(["--plan", "rerun", "--budget", "120"])
    assert args.plan == "rerun" and args.seeds == 1
    for extra in (["--seeds", "2"], ["--systems", "ddp"], ["--scenario", "lan"], ["--smoke"]):
        with pytest.raises(SystemExit):
            parse_args(["--plan", "rerun", *extra])
    assert "--plan names its own" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--seeds", "0"])
