"""Shared fixtures: real daemons in subprocesses on loopback, ports 0."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from moshpitd.launcher import LocalSwarm


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
