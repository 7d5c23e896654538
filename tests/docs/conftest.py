"""One swarm of real daemons for every documented example (they use distinct keys)."""

from __future__ import annotations

import multiprocessing.forkserver
from collections.abc import Iterator

import pytest

from moshpitd.launcher import LocalSwarm
from tests.docs.runner import trainer_context

SWARM_SIZE = 4  # the most trainers an example runs at once


@pytest.fixture(scope="session")
def docs_swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    # the trainers' fork server imports torch meanwhile
    trainer_context()
    multiprocessing.forkserver.ensure_running()
    swarm = LocalSwarm(SWARM_SIZE, workdir=tmp_path_factory.mktemp("docs-swarm"))
    swarm.start()
    yield swarm
    swarm.stop()
