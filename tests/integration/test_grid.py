"""The Moshpit grid with 16 real daemons: exact means, convergence, peers dying mid-matchmaking."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import moshpit
from moshpitd.launcher import LocalSwarm
from tests.integration.helpers import assert_close_to_mean, run_parallel

N = 16


@pytest.fixture(scope="module")
def swarm16(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    swarm = LocalSwarm(N, workdir=Path(tmp_path_factory.mktemp("grid16")))
    swarm.start()
    yield swarm
    swarm.stop()


def mse(values: list[torch.Tensor], mean: torch.Tensor) -> float:
    return float(np.mean([((v.double() - mean) ** 2).mean().item() for v in values]))


def test_full_grid_exact_weighted_mean_after_two_rounds(swarm16: LocalSwarm) -> None:
    clients = [moshpit.Client(s) for s in swarm16.sockets]
    g = torch.Generator().manual_seed(1)
    xs = [[torch.randn(5000, generator=g), torch.randn(3, 7, generator=g, dtype=torch.float64)]
          for _ in range(N)]
    weights = [1.0 + 0.5 * i for i in range(N)]
    results = run_parallel([
        lambda i=i: clients[i].average(xs[i], key="full", grid=(4, 2), weight=weights[i],
                                       rounds=2, initial_coords=(i // 4, i % 4), timeout=60)
        for i in range(N)
    ])
    for i, r in enumerate(results):
        assert not isinstance(r, Exception), (i, r)
        info = clients[i].last_round
        assert info is not None and info.group_sizes == (4, 4), info
        assert info.coords == (i // 4, i % 4)
        for k in range(2):
            assert_close_to_mean(r[k], [x[k] for x in xs], weights)


def test_random_coordinates_converge_within_eight_rounds(swarm16: LocalSwarm) -> None:
    clients = [moshpit.Client(s) for s in swarm16.sockets]
    g = torch.Generator().manual_seed(2)
    values = [torch.randn(1000, generator=g) for _ in range(N)]
    mean = torch.stack([v.double() for v in values]).mean(0)
    start = mse(values, mean)
    history = []
    for _ in range(8):
        results = run_parallel([
            lambda i=i, v=values[i]: clients[i].average([v], key="random", grid=(4, 2),
                                                        timeout=60)
            for i in range(N)
        ])
        assert all(not isinstance(r, Exception) for r in results), results
        values = [r[0] for r in results]
        history.append(mse(values, mean) / start)
    assert min(history) <= 1e-6, history
    coords = {c.last_round.coords for c in clients if c.last_round is not None}
    assert len(coords) == N, f"cells chosen: {sorted(coords)}"  # the emptiest-cell rule filled it
    # a request with another grid for the same run is refused clearly
    with pytest.raises(moshpit.GridMismatch, match="grid"):
        clients[0].average([values[0]], key="random", grid=(2, 4), timeout=10)
    newcomer = moshpit.Client(swarm16.add().socket)  # a daemon new to the run
    with pytest.raises(moshpit.GridMismatch, match="16 peer"):
        newcomer.average([values[0]], key="random", grid=(2, 4), timeout=10)


def test_two_daemons_killed_during_matchmaking(swarm_factory: Callable[..., LocalSwarm]) -> None:
    swarm = swarm_factory(N)
    clients = [moshpit.Client(s) for s in swarm.sockets]
    x = [torch.full((100,), float(i)) for i in range(N)]

    def round_for(ids: list[int], timeout: float = 30) -> list[object]:
        return run_parallel([
            lambda i=i: clients[i].average([x[i]], key="kill", grid=(4, 2), timeout=timeout,
                                           initial_coords=(i // 4, i % 4))
            for i in ids
        ])

    assert all(not isinstance(r, Exception) for r in round_for(list(range(N))))
    victims = [5, 10]  # on different lines of both axes
    # the victims start the next round first and wait in matchmaking for their line-mates
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(2) as pool:
        pending = [pool.submit(clients[v].average, [x[v]], key="kill", grid=(4, 2), timeout=30,
                               initial_coords=(v // 4, v % 4)) for v in victims]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(
            _matchmaking(swarm.sockets[v]) for v in victims
        ):
            time.sleep(0.01)
        for v in victims:
            swarm.daemons[v].kill()
        for f in pending:
            assert isinstance(f.exception(30), moshpit.DaemonUnavailable)
    survivors = [i for i in range(N) if i not in victims]
    for _ in range(2):  # this round and the next go on without them, within the deadline
        started = time.monotonic()
        results = round_for(survivors, timeout=10)
        assert all(not isinstance(r, Exception) for r in results), results
        assert time.monotonic() - started < 10
        sizes = sorted(clients[i].last_round.group_size for i in survivors)  # type: ignore[union-attr]
        assert sizes.count(4) >= 6 and max(sizes) == 4 and min(sizes) >= 3, sizes
    for i in survivors:
        assert swarm.daemons[i].alive()


def _matchmaking(socket_path: str) -> bool:
    with moshpit.Client(socket_path) as c:
        return bool(c.status()["status"]["active_keys"])
