"""The hivemind rows' settings: each rule, the knobs, hivemind's own warnings, and the table in
docs/results.md, which must be the one the code declares (hivemind_settings.settings_table)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench.swarm.systems.hivemind_settings import (
    DEFAULTS,
    DILOCO_PERIOD,
    DOC_BATCH,
    DOC_HOSTS,
    DOC_LR,
    LOCAL,
    SETTINGS,
    SMOKE_KNOBS,
    SYNC,
    SettingsError,
    settings,
    settings_table,
)
from bench.swarm.workload import DEFAULT_HYPER

DOCS = Path(__file__).resolve().parents[2] / "docs" / "results.md"


def test_local_mode_averages_at_the_diloco_rows_period_at_ddps_rate() -> None:
    s = settings(LOCAL, hosts=4, batch=8, lr=1e-3, knobs={"bandwidth": 20})
    assert s.use_local_updates and s.target_batch_size == 4 * 8 * DILOCO_PERIOD
    assert s.lr == 1e-3 and s.average_state_every == 1
    kwargs = s.optimizer_kwargs()
    assert kwargs["averager_opts"] == {"target_group_size": 4, "request_timeout": 1.5,
                                       "bandwidth": 20.0}
    assert "delay_optimizer_step" not in kwargs  # local steps: nothing to delay
    assert (kwargs["matchmaking_time"], kwargs["averaging_timeout"]) == (3.0, 10.0)


def test_sync_mode_large_batch_square_root_rate_rare_state_averaging_delayed_updates() -> None:
    s = settings(SYNC, hosts=4, batch=8, lr=1e-3, knobs={})
    steps = DEFAULTS[SYNC]["epoch_steps"]
    assert not s.use_local_updates and s.target_batch_size == 4 * 8 * steps
    assert math.isclose(s.lr, 1e-3 * math.sqrt(steps))
    assert s.average_state_every >= 10 and s.fp16
    kwargs = s.optimizer_kwargs()
    assert kwargs["delay_optimizer_step"] is kwargs["delay_grad_averaging"] is True
    # DDP's batch at DDP's rate: the alternative it is measured against
    alt = settings(SYNC, 4, 8, 1e-3, {"epoch_steps": 1})
    assert (alt.target_batch_size, alt.lr) == (32, 1e-3)
    flat = settings(SYNC, 4, 8, 1e-3, {"lr_rule": "none"})
    assert flat.lr == 1e-3


def test_knobs_override_and_hivemind_warnings_are_refused() -> None:
    s = settings(SYNC, 4, 8, 1e-3, {"target_batch_size": 100, "matchmaking_time": 5.0,
                                    "target_group_size": 2, "fp16": False})
    assert (s.target_batch_size, s.matchmaking_time, s.target_group_size, s.fp16) == \
        (100, 5.0, 2, False)
    with pytest.raises(SettingsError, match="smaller than matchmaking_time"):
        settings(LOCAL, 4, 8, 1e-3, {"request_timeout": 3.0})
    with pytest.raises(SettingsError, match="lr_rule"):
        settings(SYNC, 4, 8, 1e-3, {"lr_rule": "linear"})
    with pytest.raises(SettingsError, match="not a hivemind row"):
        settings("ddp", 4, 8, 1e-3, {})


def test_the_smokes_periods_let_each_row_average_within_its_budget() -> None:
    """--smoke trains the tiny model 12 s at 10 or more steps a second per host: each epoch
    (an averaging round) must fit several times."""
    for system, knobs in SMOKE_KNOBS.items():
        s = settings(system, 4, DEFAULT_HYPER.batch, DEFAULT_HYPER.lr, knobs)
        steps_per_host = s.target_batch_size / (4 * DEFAULT_HYPER.batch)
        assert steps_per_host / 10 * 3 <= 12.0, system
        assert s.average_state_every * steps_per_host / 10 <= 6.0, system


def test_every_setting_cites_a_source_and_the_table_says_the_defaults() -> None:
    for setting in SETTINGS:
        assert setting.sources and all(src.line and src.where for src in setting.sources)
    assert (4, DEFAULT_HYPER.batch, DEFAULT_HYPER.lr) == (DOC_HOSTS, DOC_BATCH, DOC_LR)
    table = settings_table()
    steps = DEFAULTS[SYNC]["epoch_steps"]
    assert f"hosts x batch x {steps} ({4 * DEFAULT_HYPER.batch * steps})" in table
    assert f"hosts x batch x {DILOCO_PERIOD} ({4 * DEFAULT_HYPER.batch * DILOCO_PERIOD})" \
        in table
    sync = settings(SYNC, 4, DEFAULT_HYPER.batch, DEFAULT_HYPER.lr, {})
    assert f"({sync.lr:.2e})" in table
    assert (f"| {DEFAULTS[SYNC]['average_state_every']} "
            f"| {DEFAULTS[LOCAL]['average_state_every']} |") in table


def test_docs_hold_the_declared_table() -> None:
    assert settings_table() in DOCS.read_text(), (
        "docs/results.md's hivemind settings table differs from "
        "bench.swarm.systems.hivemind_settings.settings_table(): paste its output")
