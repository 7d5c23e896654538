"""Rounds while trainers saturate the host: busy-loop processes take every core, and the
daemons' rounds must still complete, with every member counted, and stay exact."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import torch

import moshpit
from bench.load import spinning
from bench.procs import cpu_seconds
from moshpitd.launcher import LocalSwarm
from tests.integration.helpers import run_parallel
from tests.integration.test_grid import check_round

BUSY = 4  # processes spinning in pure Python, on a machine of 2 cores in CI
ROUNDS = 3
ELEMS = 200_000


@pytest.fixture
def busy() -> Iterator[list[int]]:
    with spinning(BUSY) as pids:  # the same spinners as `python -m bench.load`
        yield pids


def test_rounds_stay_exact_while_the_cores_are_busy(swarm4: LocalSwarm,
                                                     busy: list[int]) -> None:
    ids = [d.info["peer_id"] for d in swarm4.daemons]
    weights = {pid: 1.0 + i for i, pid in enumerate(ids)}
    clients = [moshpit.Client(s) for s in swarm4.sockets]
    spun, started = cpu_seconds(busy), time.monotonic()
    try:
        for r in range(ROUNDS):
            inputs = {pid: torch.randn(ELEMS, generator=torch.Generator().manual_seed(10 * r + i))
                      for i, pid in enumerate(ids)}

            def one(i: int, r: int = r, inputs: dict[str, torch.Tensor] = inputs) -> set[str]:
                (out,) = clients[i].average([inputs[ids[i]]], key=f"load-{r}",
                                            weight=weights[ids[i]], group_size=len(ids),
                                            timeout=20)
                info = clients[i].last_round
                assert info is not None and info.fully_averaged, info
                return check_round(out, info, ids[i], inputs, weights)

            seen = run_parallel([lambda i=i: one(i) for i in range(len(ids))])
            assert seen == [set(ids)] * len(ids), seen  # every member in every peer's mean
        # the load was there all along: the loops kept at least half a core busy meanwhile
        cores = (cpu_seconds(busy) - spun) / (time.monotonic() - started)
        # (or the machine was busier still: other work took the cores from the loops)
        assert cores > 0.5 or os.getloadavg()[0] >= (os.cpu_count() or 1), cores
    finally:
        for c in clients:
            c.close()
