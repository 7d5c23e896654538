"""Checked reductions with real daemons: 4 peers under one swarm key (checks are on by default
then), one of them an owner that returns 1000.0 for every element of its span.

Every honest trainer gets, for the liar's span, its own values (mask 0) and, elsewhere, the
aggregate of the members its masks name; no element is 1000.0. Every honest daemon names the
liar in its log and /metrics, and the next round forms without it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import moshpit
from moshpitd.launcher import LocalSwarm
from tests.integration.helpers import run_parallel, scrape

PEERS = 4
LIAR = 1
ELEMS = 100_000


def inputs(i: int) -> torch.Tensor:
    return 1 + torch.randn(ELEMS, generator=torch.Generator().manual_seed(500 + i))


def average(client: moshpit.Client, i: int, key: str, aggregation: str, size: int
            ) -> list[torch.Tensor]:
    return client.average([inputs(i)], key=key, timeout=30, group_size=size,
                          min_group_size=size, aggregation=aggregation)


@pytest.mark.parametrize("aggregation", ["mean", "trimmed_mean"])
def test_a_lying_owner_is_caught_and_left_out(tmp_path: Path, aggregation: str,
                                              swarm_factory: Callable[..., LocalSwarm]
                                              ) -> None:
    key = tmp_path / "swarm.key"
    key.write_bytes(os.urandom(32).hex().encode() + b"\n")
    key.chmod(0o600)
    swarm = swarm_factory(PEERS, extra_args=["--swarm-key-file", str(key), "--bandwidth", "1"],
                          env_by_index={LIAR: {"MOSHPITD_FAULT": "lie-results@1"}})
    clients = [moshpit.Client(s) for s in swarm.sockets]
    ids = {d.info["peer_id"]: i for i, d in enumerate(swarm.daemons)}
    honest = [i for i in range(PEERS) if i != LIAR]
    results = run_parallel([lambda i=i: average(clients[i], i, "lie", aggregation, PEERS)
                            for i in range(PEERS)])
    for i in honest:
        out, info = results[i], clients[i].last_round
        assert isinstance(out, list) and info is not None, out
        got = out[0].numpy()
        assert not np.any(got == 1000.0)
        members = [ids[m] for m in info.members]
        assert sorted(members) == list(range(PEERS))
        kept = 0
        for start, stop, mask in info.spans:
            if mask == 0:
                np.testing.assert_array_equal(got[start:stop], inputs(i).numpy()[start:stop])
                kept += stop - start
                continue
            rows = np.stack([inputs(members[b]).numpy()[start:stop]
                             for b in range(PEERS) if mask >> b & 1])
            assert members.index(LIAR) in [b for b in range(PEERS) if mask >> b & 1]
            if aggregation == "mean":
                np.testing.assert_allclose(got[start:stop], rows.mean(axis=0), rtol=1e-5,
                                           atol=1e-6)
            else:
                assert np.all(got[start:stop] >= rows.min(axis=0) - 1e-6)
                assert np.all(got[start:stop] <= rows.max(axis=0) + 1e-6)
        assert kept == ELEMS // PEERS, info.spans  # the liar's span, and only it
        metrics = scrape(swarm.daemons[i])
        assert metrics['moshpitd_span_checks_total{result="failed"}'] == 1
        assert metrics['moshpitd_span_checks_total{result="passed"}'] == PEERS - 2
        liar_id = swarm.daemons[LIAR].info["peer_id"]
        assert metrics[f'moshpitd_check_last_liar_info{{peer_id="{liar_id}"}}'] == 1
        assert metrics["moshpitd_check_liars"] == 1
        assert liar_id in swarm.daemons[i].log_path.read_text()
    # the honest daemons no longer group with the liar: a round of 3 without it completes
    again = run_parallel([lambda i=i: average(clients[i], i, "again", aggregation, PEERS - 1)
                          for i in honest])
    for i, out in zip(honest, again, strict=True):
        info = clients[i].last_round
        assert isinstance(out, list) and info is not None, out
        assert sorted(ids[m] for m in info.members) == honest
        assert all(mask for _, _, mask in info.spans)
    for c in clients:
        c.close()
