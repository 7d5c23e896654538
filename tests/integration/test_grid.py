"""The Moshpit grid with real daemons: exact means, convergence, peers dying mid-matchmaking,
a peer catching up to the swarm's round after sitting out."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import moshpit
from moshpitd.launcher import LocalSwarm
from tests.fuzz.target import find_subs
from tests.integration.helpers import assert_close_to_mean, run_parallel, wait_until

N = 16


@pytest.fixture(scope="module")
def swarm16(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    swarm = LocalSwarm(N, workdir=Path(tmp_path_factory.mktemp("grid16")))
    swarm.start()
    yield swarm
    swarm.stop()


def mse(values: list[torch.Tensor], mean: torch.Tensor) -> float:
    return float(np.mean([((v.double() - mean) ** 2).mean().item() for v in values]))


def check_round(result: torch.Tensor, info: moshpit.RoundInfo | None, own: str,
                inputs: dict[str, torch.Tensor], weights: dict[str, float]) -> set[str]:
    """Every element is the weighted mean of the members the round reports for it (its own
    value where it reports none); returns the peer ids of the reported group."""
    assert info is not None
    if info.group_size == 1:  # alone: it kept its value (spans and members are not about it)
        torch.testing.assert_close(result, inputs[own], rtol=0, atol=0)
        return {own}
    covered = 0
    for start, stop, mask in info.spans:
        covered += stop - start
        peers = [p for b, p in enumerate(info.members) if mask >> b & 1] or [own]
        want = sum(weights[p] * inputs[p][start:stop].double() for p in peers)
        torch.testing.assert_close(result[start:stop].double(),
                                   want / sum(weights[p] for p in peers), rtol=1e-6, atol=1e-6)
    assert covered == result.numel()
    return set(info.members)


def last(client: moshpit.Client) -> moshpit.RoundInfo:
    info = client.last_round
    assert info is not None
    return info


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
    """Round 1 averages along rows. Fourteen peers start it together, victims 5 and 10 among
    them; 7 and 11 (a line-mate of each victim) come later, so rows 1 and 2 are still
    matchmaking, victims included, when the victims are SIGKILLed. Then 7 and 11 call. Every
    survivor finishes within its deadline, without waiting out a matchmaking attempt (5 s)
    for the dead; its result is the weighted mean of the group it reports, and the next round
    (columns) goes on without the victims."""
    swarm = swarm_factory(N)
    ids = [d.info["peer_id"] for d in swarm.daemons]
    clients = [moshpit.Client(s) for s in swarm.sockets]
    values = {p: torch.randn(300, generator=torch.Generator().manual_seed(i))
              for i, p in enumerate(ids)}
    weights = {p: 1.0 + i for i, p in enumerate(ids)}
    timeout = 10.0

    def call(i: int) -> tuple[list[torch.Tensor], float]:
        out = clients[i].average([values[ids[i]]], key="kill", grid=(4, 2), timeout=timeout,
                                 weight=weights[ids[i]], initial_coords=(i // 4, i % 4))
        return out, time.monotonic()

    def check(results: dict[int, Any], round_: int, started: float,
              dead: frozenset[str] = frozenset()) -> list[int]:
        """The sizes of the groups the peers report, checking each peer's result."""
        sizes = []
        for i, r in results.items():
            assert not isinstance(r, BaseException), (i, r)
            assert r[1] - started < timeout
            info = clients[i].last_round
            assert info is not None and info.round == round_, info
            group = check_round(r[0][0], info, ids[i], values, weights)
            assert info.fully_averaged and not group & dead, (i, info)
            sizes.append(len(group))
        for i, r in results.items():
            values[ids[i]] = r[0][0]
        return sorted(sizes)

    victims, late = [5, 10], [7, 11]
    started = time.monotonic()
    check(dict(enumerate(run_parallel([lambda i=i: call(i) for i in range(N)]))), 0, started)
    first = [i for i in range(N) if i not in late]
    with ThreadPoolExecutor(N) as pool:
        started = time.monotonic()
        pending = {i: pool.submit(call, i) for i in first}
        while not all(_matchmaking(swarm.sockets[i]) for i in [4, 5, 6, 8, 9, 10]):
            assert time.monotonic() < started + 10, "rows 1 and 2 never started matchmaking"
            time.sleep(0.01)
        # they declared in their rows' groups (round 1 averages along rows) and wait for
        # 7 and 11 (a record lives on the few daemons closest to its key: ask them all)
        wait_until(lambda: all(any(declared(d.dht, f"kill/1/{row}", ids[i])
                                   for d in swarm.daemons)
                               for row in (1, 2) for i in range(4 * row, 4 * row + 3)), 10,
                   "rows 1 and 2 declared")
        assert not any(pending[i].done() for i in [4, 5, 6, 8, 9, 10])
        for v in victims:
            swarm.daemons[v].kill()
        pending.update({i: pool.submit(call, i) for i in late})
        for v in victims:
            assert isinstance(pending.pop(v).exception(30), moshpit.DaemonUnavailable)
        outcomes = {i: f.result(30) for i, f in pending.items()}
    dead = frozenset(ids[v] for v in victims)
    assert check(outcomes, 1, started, dead) == [3] * 6 + [4] * 8  # rows 1, 2 lost a peer
    assert max(r[1] for r in outcomes.values()) - started < 5.0
    survivors = sorted(outcomes)
    started = time.monotonic()
    results = dict(zip(survivors, run_parallel([lambda i=i: call(i) for i in survivors]),
                       strict=True))
    assert check(results, 2, started, dead) == [3] * 6 + [4] * 8  # so did columns 1, 2
    assert max(r[1] for r in results.values()) - started < 5.0
    for i in survivors:
        assert swarm.daemons[i].alive()


def test_peer_that_sat_out_rounds_catches_up(swarm_factory: Callable[..., LocalSwarm]) -> None:
    """Four daemons on a 2x2 grid. Peer 3 averages in round 0, then sits out rounds 1 and 2
    (its line-mates wait for it until their 2 s deadline and keep their values), and comes
    back: its next round is the swarm's round 3, not its own 1, and it averages there."""
    swarm = swarm_factory(4)
    ids = [d.info["peer_id"] for d in swarm.daemons]
    clients = [moshpit.Client(s) for s in swarm.sockets]
    values = {p: torch.randn(100, generator=torch.Generator().manual_seed(i))
              for i, p in enumerate(ids)}
    weights = {p: 1.0 + i for i, p in enumerate(ids)}

    def round_for(peers: list[int], round_: int, timeout: float) -> None:
        results = run_parallel([
            lambda i=i: clients[i].average([values[ids[i]]], key="late", grid=(2, 2),
                                           weight=weights[ids[i]], timeout=timeout,
                                           initial_coords=(i // 2, i % 2))
            for i in peers
        ])
        for i, r in zip(peers, results, strict=True):
            assert not isinstance(r, BaseException), (i, r)
            info = clients[i].last_round
            assert info is not None and info.round == round_, (i, info)
            check_round(r[0], info, ids[i], values, weights)
        for i, r in zip(peers, results, strict=True):
            values[ids[i]] = r[0]

    def run_round(i: int) -> int:
        return int(clients[i].status()["status"]["runs"]["late"]["round"])

    round_for([0, 1, 2, 3], 0, timeout=10)
    for r in (1, 2):
        round_for([0, 1, 2], r, timeout=2)
    assert [run_round(i) for i in range(4)] == [3, 3, 3, 1]
    round_for([0, 1, 2, 3], 3, timeout=10)
    assert last(clients[3]).group_size == 2 and set(last(clients[3]).members) == {ids[2], ids[3]}
    assert [run_round(i) for i in range(4)] == [4, 4, 4, 4]


def declared(dht: str, key: str, peer_id: str) -> bool:
    """A DHT node holds the peer's live declaration under the group key."""
    subs = find_subs(dht, key)
    return isinstance(subs, list) and any(bytes(r[0]).hex() == peer_id and r[1] != b""
                                          for r in subs)


def _matchmaking(socket_path: str) -> bool:
    with moshpit.Client(socket_path) as c:
        return bool(c.status()["status"]["active_keys"])
