"""Shared fixtures: real daemons in subprocesses on loopback, ports 0."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from moshpitd.launcher import LocalSwarm

# The files that take longest (seconds measured under `make test`'s three processes), started
# first: `make test` keeps this order (--no-loadscope-reorder), so no process is left with a
# three-minute file at the end while the others sit idle. pytest-xdist's own order is by the
# number of tests in a file, which puts these single long tests last.
LONGEST_FIRST = (  # seconds each took in a full run at -n 4 on 2 cores
    "tests/integration/test_swarm_smoke.py",  # ~160 s
    "tests/integration/test_faults.py",  # ~160 s, mostly waiting out deadlines
    "tests/integration/test_fuzz_ipc.py",  # ~160 s (20 s on an idle machine)
    "tests/integration/test_optimizer.py",  # ~130 s
    "tests/integration/test_demo.py",  # ~125 s
    "tests/integration/test_join.py",  # ~110 s
    "tests/integration/test_swarm_multi_smoke.py",  # ~90 s
    "tests/integration/test_soak.py",  # ~50 s alone: the churn soak, then under attack
    "tests/integration/test_bench_allreduce_netns.py",
    "tests/integration/test_state.py",
    "tests/integration/test_netns.py",
    "tests/integration/test_grid.py",
    "tests/integration/test_average.py",
    "tests/integration/test_fuzz_dht.py",
    "tests/integration/test_ipc_robustness.py",
    "tests/integration/test_fuzz_grpc.py",
    "tests/integration/test_wheel.py",
    "tests/docs/test_examples.py",
    "tests/integration/test_swarm_diloco_worker.py",
    "tests/integration/test_diloco_bench.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}

    def order(item: pytest.Item) -> int:
        return rank.get(item.nodeid.split("::", 1)[0], len(LONGEST_FIRST))

    items.sort(key=order)  # stable: within a file, and among the rest, collection order


@pytest.fixture
def swarm_factory(tmp_path: Path) -> Iterator[Callable[..., LocalSwarm]]:
    """Start swarms of real daemons; every one is stopped at teardown, logs shown on failure."""
    started: list[LocalSwarm] = []

    def make(size: int, **kwargs: object) -> LocalSwarm:
        swarm = LocalSwarm(size, workdir=tmp_path / f"swarm{len(started)}", **kwargs)  # type: ignore[arg-type]
        started.append(swarm)
        return swarm.start()

    yield make
    for swarm in started:
        swarm.stop()


@pytest.fixture
def swarm4(swarm_factory: Callable[..., LocalSwarm]) -> LocalSwarm:
    return swarm_factory(4)
