"""Several trainers per host: the scenario knob, which daemon and peer each trainer is, the
systems each scenario runs, and the per-trainer sync seconds."""

from __future__ import annotations

import pytest

from bench.swarm import metrics
from bench.swarm.layout import Layout, daemon_ports
from bench.swarm.plan import plan_systems
from bench.swarm.scenario import ScenarioError, load, parse
from bench.swarm.systems import MULTI_TRAINER_SYSTEMS, SINGLE_TRAINER_SYSTEMS, SMOKE_SYSTEMS
from bench.swarm.worker import SpecError, WorkerSpec


def test_multi_scenario_has_two_trainers_per_host_on_the_wan_links() -> None:
    multi, wan = load("multi"), load("wan")
    assert multi.trainers_per_host == 2 and multi.hosts == 4
    assert multi.links == wan.links and not multi.events
    assert wan.trainers_per_host == 1


@pytest.mark.parametrize("value, message", [(0, "1..8"), (9, "1..8"), ("2", "wrong type")])
def test_bad_trainers_per_host(value: object, message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        parse({"host": [{"rate_mbit": 10}], "trainers_per_host": value}, "bad")


def test_local_is_one_peer_per_host_each_is_one_per_trainer() -> None:
    local, each = Layout("moshpit-local", 4, 2), Layout("moshpit-each", 4, 2)
    assert (local.peers, local.daemons_per_host, local.local_world) == (4, 1, 2)
    assert (each.peers, each.daemons_per_host, each.local_world) == (8, 2, None)
    assert [local.daemon(t) for t in range(2)] == [0, 0]
    assert [each.daemon(t) for t in range(2)] == [0, 1]
    assert [local.peer(3, t) for t in range(2)] == [3, 3]
    assert sorted(each.peer(h, t) for h in range(4) for t in range(2)) == list(range(8))
    # a preempted host's peers leave the final sync: all of them
    assert local.knobs(1, 1, 3) == {"peers": 4, "peer": 1, "local_world": 2, "final_group": 3}
    assert each.knobs(1, 1, 3) == {"peers": 8, "peer": 3, "local_world": None,
                                   "final_group": 6}
    one = Layout("moshpit", 4)
    assert (one.peers, one.daemons_per_host, one.local_world) == (4, 1, None)
    assert Layout("ddp", 4).daemons_per_host == 0
    with pytest.raises(ValueError, match="one trainer per host"):
        Layout("ddp", 4, 2)


def test_a_hosts_daemons_get_distinct_ports_clear_of_the_workers_and_the_delayer() -> None:
    ports = [p for i in range(8) for p in daemon_ports(i)]
    assert daemon_ports(0) == (7700, 7701, 7702)
    assert len(set(ports)) == len(ports)
    assert not set(ports) & set(range(7710, 7720)) and max(ports) < 7799


def test_a_multi_trainer_scenario_runs_only_the_systems_that_can() -> None:
    lan, multi = load("lan"), load("multi")
    plan, skipped = plan_systems([lan, multi], None, smoke=False)
    # hivemind's rows are skipped where .venv-peers is missing, and only those
    assert plan == {"lan": [s for s in SINGLE_TRAINER_SYSTEMS if s not in skipped],
                    "multi": list(MULTI_TRAINER_SYSTEMS)}
    assert all(s.startswith("hivemind") for s in skipped)
    plan, skipped = plan_systems([multi], ["moshpit", "moshpit-local"], smoke=True)
    assert plan == {"multi": ["moshpit-local"]}
    assert "one trainer per host" in skipped["multi/moshpit"]
    plan, _ = plan_systems([lan], None, smoke=True)
    assert set(plan["lan"]) <= set(SMOKE_SYSTEMS)


def test_worker_spec_checks_the_trainer_index() -> None:
    raw = {"system": "moshpit-local", "host": 0, "hosts": 2, "host_ips": ["a", "b"],
           "port_base": 7710, "model": "tiny", "batch": 8, "seq_len": 64, "lr": 1e-3,
           "weight_decay": 0.1, "budget_s": 5, "start_at": 1.0, "out_dir": "/tmp/x",
           "shared_dir": "/tmp", "ipc_socket": "/tmp/s", "trainer": 1, "trainers_per_host": 2}
    assert WorkerSpec.from_dict(raw).trainer == 1
    with pytest.raises(SpecError, match="trainer 2 of 2"):
        WorkerSpec.from_dict({**raw, "trainer": 2})


def test_sync_seconds_are_per_trainer() -> None:
    events = [{"event": "sync", "ok": True, "group_size": 4, "seconds": 3.0}]
    record = {"config": {"hosts": 2}, "trainers_per_host": 2,
              "workers": [{"events": events} for _ in range(4)]}
    assert metrics.syncs(record)["sync_seconds_per_host"] == pytest.approx(3.0)
    assert metrics.syncs({**record, "trainers_per_host": 1})["sync_seconds_per_host"] == \
        pytest.approx(6.0)
