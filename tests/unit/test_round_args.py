"""RoundArgs (client/round_args.py): what moshpit.Optimizer hands Client.average every round."""

from __future__ import annotations

from typing import Any

import pytest

from moshpit.round_args import RoundArgs


def test_local_arguments_go_through_only_when_set() -> None:
    plain = RoundArgs("run").average_kwargs()
    assert "local_world" not in plain and "local_rank" not in plain  # any client takes them
    shards = RoundArgs("run", local_world=4, local_rank=3).average_kwargs()
    assert shards["local_world"] == 4 and shards["local_rank"] == 3
    assert RoundArgs("run", local_world=4).average_kwargs()["local_rank"] is None


def test_each_shard_rank_publishes_its_own_state() -> None:
    assert RoundArgs("run").state_key == "run/state"
    assert RoundArgs("run", local_world=2).state_key == "run/state"  # replicas: one state
    assert RoundArgs("run", local_world=2, local_rank=1).state_key == "run/state/rank1"


@pytest.mark.parametrize("kwargs,says", [
    (dict(local_rank=0), "local_rank needs local_world"),
    (dict(local_world=0), "local_world must be in 1..1024"),
    (dict(local_world=2, local_rank=2), "local_rank must be in 0..1"),
    (dict(aggregation="median"), "aggregation must be one of"),
])
def test_bad_arguments_fail_before_any_round(kwargs: dict[str, Any], says: str) -> None:
    """moshpit.Optimizer builds its RoundArgs in its constructor: a bad argument fails there,
    before any round."""
    with pytest.raises(ValueError, match=says):
        RoundArgs("run", **kwargs)


def test_sync_keeps_the_local_arguments() -> None:
    args = RoundArgs("run", group_size=4, timeout=10.0, local_world=2, local_rank=0)
    merged = {**args.average_kwargs(), **args.sync_overrides(8, None)}
    assert merged["key"] == "run/sync" and merged["group_size"] == 8
    assert merged["timeout"] == 25.0 and merged["local_world"] == 2
