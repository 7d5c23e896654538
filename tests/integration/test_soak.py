"""The short churn soak (`make soak` runs 50 rounds): 8 daemons, one SIGKILLed mid-round and
restarted every round; no other daemon dies and no result is corrupt."""

from __future__ import annotations

from pathlib import Path

from bench.soak import run


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
