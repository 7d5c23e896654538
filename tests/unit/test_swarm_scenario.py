"""Scenario files, the cgroup layer on a fake hierarchy, and the table's arithmetic."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from bench.swarm import metrics
from bench.swarm.scenario import DEFAULT_SCENARIOS, ScenarioError, load, parse
from netlab import LinkSpec, parse_rate
from netlab.cgroup import CgroupError, CpuGroup, cgroup_problem
from netlab.links import nft_rules, tbf_args


def test_shipped_scenarios_load() -> None:
    lan, wan, churn = (load(name) for name in DEFAULT_SCENARIOS)
    assert lan.links_for(4) == [LinkSpec(1000.0, 0.0, 0.0)] * 4
    assert [link.rate_mbit for link in wan.links_for(4)] == [200, 100, 50, 20]
    assert {link.loss_pct for link in wan.links_for(4)} == {0.5}
    assert churn.links == wan.links
    preempt = next(e for e in churn.events if e.kind == "preempt")
    assert preempt.host_index(4) == 3 and preempt.until is not None
    slow = next(e for e in churn.events if e.kind == "rate")
    assert slow.factor == 0.25 and slow.host_index(4) == 1


def test_links_cycle_and_events_resolve_for_more_hosts() -> None:
    churn = load("churn")
    links = churn.links_for(8)
    assert links[4:] == links[:4]
    assert next(e for e in churn.events if e.kind == "preempt").host_index(8) == 7


@pytest.mark.parametrize("data, message", [
    ({"host": []}, "at least one"),
    ({"host": [{"rate_mbit": 10, "delay": 5}]}, "unknown keys"),
    ({"host": [{"rate_mbit": "fast"}]}, "wrong type"),
    ({"host": [{"delay_ms": 5}]}, "rate_mbit is required"),
    ({"host": [{"rate_mbit": 10, "loss_pct": 100}]}, "loss_pct"),
    ({"host": [{"rate_mbit": 10}], "event": [{"kind": "reboot", "host": 0, "at": 0.1}]},
     "not one of"),
    ({"host": [{"rate_mbit": 10}], "event": [{"kind": "preempt", "host": 0, "at": 0.5,
                                              "until": 0.4}]}, "at < until"),
    ({"host": [{"rate_mbit": 10}], "hosts": 4,
      "event": [{"kind": "rate", "host": 9, "at": 0.1}]}, "host 9"),
    ({"host": [{"rate_mbit": 10}], "hosts": 2,
      "event": [{"kind": "preempt", "host": 0, "at": 0.1},
                {"kind": "preempt", "host": 1, "at": 0.2}]}, "every host"),
])
def test_bad_scenarios_say_what_is_wrong(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        parse(data, "bad")


def test_unknown_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="no scenario file"):
        load(tmp_path / "missing.toml")
    bad = tmp_path / "broken.toml"
    bad.write_text("hosts = [")
    with pytest.raises(ScenarioError, match=r"broken\.toml"):
        load(bad)


def test_rates_and_rules() -> None:
    assert parse_rate("1gbit") == 1000 and parse_rate("500kbit") == 0.5 and parse_rate(20) == 20
    with pytest.raises(ValueError):
        parse_rate("fast")
    assert tbf_args(20)[:2] == ["tbf", "rate"] and "20000kbit" in tbf_args(20)
    assert int(tbf_args(1000)[4]) >= 250_000  # 2 ms at 1 Gbit/s
    rules = nft_rules(LinkSpec(100, 0.0, 0.5), 7800)
    assert "tproxy" not in rules and "mod 10000 < 50 " in rules
    assert "tproxy to :7800" in nft_rules(LinkSpec(100, 0.02, 0.0), 7800)


def _fake_v1(root: Path) -> None:
    for name in ("cpu", "cpuacct"):
        (root / name).mkdir(parents=True)
    (root / "cpu" / "cpu.cfs_quota_us").write_text("-1")
    (root / "cpuacct" / "cpuacct.usage").write_text("0")


def test_cgroup_v1_layout(tmp_path: Path) -> None:
    _fake_v1(tmp_path)
    group = CpuGroup("h1", 0.5, root=tmp_path).create()
    assert group.version == 1
    assert (tmp_path / "cpu" / "h1" / "cpu.cfs_quota_us").read_text() == "50000"
    assert (tmp_path / "cpu" / "h1" / "cpu.cfs_period_us").read_text() == "100000"
    assert [p.parent.parent.name for p in group.procs_files] == ["cpu", "cpuacct"]
    command = group.join_command(["ip", "netns", "exec", "x", "true"])
    assert command[:2] == ["sh", "-c"] and command[-5:] == ["ip", "netns", "exec", "x", "true"]


def test_cgroup_v2_layout(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu memory")
    (tmp_path / "cgroup.subtree_control").write_text("")
    group = CpuGroup("h2", 1.5, root=tmp_path).create()
    assert group.version == 2
    assert (tmp_path / "h2" / "cpu.max").read_text() == "150000 100000"
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpu"


def test_no_cgroup_is_a_clear_error(tmp_path: Path) -> None:
    assert "no cgroup CPU controller" in (cgroup_problem(tmp_path) or "")
    with pytest.raises(CgroupError, match="no cgroup CPU controller"):
        CpuGroup("h", 0.5, root=tmp_path).create()


def _record(curve_losses: list[tuple[float, float]], system: str = "moshpit",
            workers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    start = 1000.0
    return {"system": system, "scenario": "wan", "start_at": start, "end_at": start + 100,
            "config": {"snapshot_every_s": 10.0, "budget_s": 100.0, "hosts": 2,
                       "model": "tiny", "seed": 0, "cpu_cores": 0.5},
            "samples": [{"t": start, "tx": [0, 0]}, {"t": start + 100, "tx": [100e6, 300e6]}],
            "actions": [],
            "workers": workers or [{"host": 0, "gen": 0, "spec": {}, "killed_at": None,
                                    "kill_reason": "", "events": [
                                        {"event": "snapshot", "t": start + t, "path": f"{t}"}
                                        for t, _ in curve_losses]}]}


def test_curve_crossing_and_bytes() -> None:
    record = _record([(10, 3.0), (20, 2.0), (30, 1.5)])
    losses = {"10": 3.0, "20": 2.0, "30": 1.5, "initial:tiny": 5.0}
    points = metrics.curve(record, losses)
    assert [p["t"] for p in points] == [0, 10, 20, 30]
    assert metrics.crossing(points, 2.5) == pytest.approx(15.0)
    assert metrics.crossing(points, 1.0) is None
    assert points[2]["bytes"] == pytest.approx(40e6)  # mean of 20 % of 100 MB and 300 MB
    assert metrics.loss_at(points, 25) == pytest.approx(1.75)


def test_the_curve_ends_on_the_models_at_the_deadline_not_after_a_final_sync() -> None:
    start = 1000.0
    events = [{"event": "snapshot", "t": start + 50, "path": "s"},
              {"event": "budget", "t": start + 100.4, "path": "b", "late_s": 0.4},
              {"event": "done", "t": start + 104, "path": "d"}]
    record = _record([], workers=[{"host": 0, "gen": 0, "spec": {}, "killed_at": None,
                                   "kill_reason": "", "events": events}])
    points = metrics.curve(record, {"s": 3.0, "b": 2.0, "d": 1.0, "initial:tiny": 5.0})
    assert [(p["t"], p["loss"]) for p in points] == [(0.0, 5.0), (50.0, 3.0),
                                                     (pytest.approx(100.4), 2.0)]


def test_goodput_keeps_only_what_survived() -> None:
    start = 1000.0
    alive = {"host": 0, "gen": 0, "spec": {}, "killed_at": None, "kill_reason": "",
             "events": [{"event": "progress", "t": start + 50, "samples": 400},
                        {"event": "done", "t": start + 100, "samples": 800, "path": "d"}]}
    killed = {"host": 1, "gen": 0, "spec": {}, "killed_at": start + 60,
              "kill_reason": "preempted",
              "events": [{"event": "progress", "t": start + 20, "samples": 100},
                         {"event": "sync", "t": start + 21, "ok": True},
                         {"event": "progress", "t": start + 59, "samples": 300}]}
    back = {"host": 1, "gen": 1, "spec": {}, "killed_at": None, "kill_reason": "",
            "events": [{"event": "done", "t": start + 100, "samples": 50, "path": "e"}]}
    result = metrics.goodput(_record([], workers=[alive, killed, back]))
    assert result["samples_kept"] == 800 + 100 + 50
    assert result["samples_lost"] == 200
    assert result["goodput"] == pytest.approx(9.5)
    assert math.isfinite(result["goodput"])
