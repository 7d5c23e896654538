"""One swarm of real daemons for every documented example (they use distinct keys)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from moshpitd.launcher import LocalSwarm

SWARM_SIZE = 4  # the most trainers an example runs at once


@pytest.fixture(scope="session")
def docs_swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    swarm = LocalSwarm(SWARM_SIZE, workdir=tmp_path_factory.mktemp("docs-swarm"))
    swarm.start()
    yield swarm
    swarm.stop()
