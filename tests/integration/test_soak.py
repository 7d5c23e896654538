"""The short churn soak (`make soak` runs 50 rounds): 8 daemons, one SIGKILLed mid-round and
restarted every round; no other daemon dies and no result is corrupt. Then the same soak under
attack, briefly (root only: the burner and the attacker run in CPU cgroups)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.attack_cost import measure
from bench.attacks.run import ATTACKS
from bench.soak import run
from bench.soak_attack import Setup, by_attack, compare, print_report
from netlab.cgroup import cgroup_problem


def test_churn_soak_short(tmp_path: Path) -> None:
    rounds = 5
    summary = run(peers=8, rounds=rounds, seed=1, workdir=tmp_path, verbose=False)
    report = summary.report()
    print(report)
    assert summary.crashes == 0, summary.problems
    assert summary.corrupt == 0, summary.problems
    # the 7 survivors of every round average: at most the victim's call and a few unlucky
    # ones (no group before their timeout) fail
    assert summary.results >= rounds * 7 - 3, report
    assert report["mean_group_size"] >= 5, report


@pytest.mark.skipif(cgroup_problem() is not None,
                    reason=f"--attack needs a CPU cgroup: {cgroup_problem()}")
def test_soak_under_attack_short(tmp_path: Path) -> None:
    """`python -m bench.soak --attack`, one round a phase: the daemons survive the attacker's
    whole mix, no result is corrupt, and the attack was real: every attack in the mix had its
    turn and sent something, and the daemons refused what a stranger or a forger sent."""
    c = compare(Setup(peers=3, rounds=1, seed=1, slot=0.3, timeout=4.0, rotations=1), tmp_path)
    print(c.report())
    for phase in (c.burner, c.attack):
        assert phase.summary.crashes == 0, phase.summary.problems
        assert phase.summary.corrupt == 0, phase.summary.problems
    assert c.burner.cpu_seconds > 0.5 and c.attack.cpu_seconds > 0.5  # both companions ran
    assert c.attack.attacker is not None
    sent = {name: {k: v for k, v in a["counts"].items() if k != "slots" and v}
            for name, a in c.attack.attacker["attacks"].items()}
    assert len(sent) == len(ATTACKS), sent
    assert all(sent.values()), sent  # each did something in its turn
    slots = c.attack.attacker["slots"]
    assert {name for name, _, _ in slots} == set(sent), slots
    # the round is attributed to the attack whose turn it began in, if any was running then
    assert sum(n for n, *_ in by_attack(c.attack.summary.timeline, slots).values()) <= 1
    print_report(c)
    refused = c.attack.daemons["refusals"]
    assert refused.get('auth_rejected_total{plane="dht"}', 0) > 0, refused  # junk datagrams
    assert sum(refused.values()) > sum(c.burner.daemons["refusals"].values()), refused


@pytest.mark.skipif(cgroup_problem() is not None,
                    reason=f"the attacker runs in a CPU cgroup: {cgroup_problem()}")
def test_attack_cost_smoke(tmp_path: Path) -> None:
    """`python -m bench.attack_cost`, one attack briefly: honest rounds ran beside it and
    after it, and the attacker's CPU was measured."""
    rows = measure(["udp-junk"], peers=3, seconds=1.5, cores=0.5, workdir=tmp_path)
    print(rows)
    assert [r[0] for r in rows[1:]] == ["none", "udp-junk"]
    none, junk = rows[1], rows[2]
    assert int(none[1]) > 0 and int(junk[1]) > 0 and int(junk[5]) > 0  # rounds ran throughout
    assert float(junk[9]) > 0.1  # the attacker worked
