"""Relays with real daemons on loopback: two daemons told they are private (as a daemon behind
NAT finds itself, moshpitd/nat/reach.py) are reached only through the public ones' relays,
and still own spans: every result is the exact mean its masks name. The NAT itself, and the
reachability check finding it, are in tests/integration/test_nat.py (network namespaces)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import moshpit
from moshpitd.launcher import LocalSwarm
from tests.integration.helpers import run_parallel, scrape, wait_until

PEERS = 4
PRIVATE = (2, 3)
ELEMS = 200_000


def inputs(i: int) -> torch.Tensor:
    return torch.randn(ELEMS, generator=torch.Generator().manual_seed(900 + i))


def relayed(client: moshpit.Client) -> dict[str, object] | None:
    reach = client.status()["status"]["reachability"]
    assert isinstance(reach, dict)
    by = reach["relayed_by"]
    return by if isinstance(by, dict) else None


@pytest.fixture
def swarm(tmp_path: Path, swarm_factory: Callable[..., LocalSwarm]) -> LocalSwarm:
    key = tmp_path / "swarm.key"
    key.write_bytes(os.urandom(32).hex().encode() + b"\n")
    key.chmod(0o600)
    return swarm_factory(PEERS, extra_args=["--swarm-key-file", str(key), "--bandwidth", "100"],
                         env_by_index={i: {"MOSHPITD_REACHABILITY": "private",
                                           # everything through the relays (direct paths:
                                           # tests/integration/test_nat.py)
                                           "MOSHPITD_DIRECT_PATHS": "false"}
                                       for i in PRIVATE})


def test_private_peers_own_spans_through_relays(swarm: LocalSwarm) -> None:
    clients = [moshpit.Client(s) for s in swarm.sockets]
    for i in PRIVATE:
        by = wait_until(lambda i=i: relayed(clients[i]), 20, f"daemon {i} relayed")
        assert clients[i].status()["status"]["grpc"] == by["grpc"]
    for i in set(range(PEERS)) - set(PRIVATE):  # the first daemon's first check finds nobody
        wait_until(lambda i=i: clients[i].status()["status"]["reachability"]["state"]
                   == "public", 20, f"daemon {i} found public")
    public_ids = {d.info["peer_id"] for i, d in enumerate(swarm.daemons) if i not in PRIVATE}
    for i in PRIVATE:
        assert clients[i].status()["status"]["reachability"]["relayed_by"]["peer_id"] in public_ids
    xs = [inputs(i) for i in range(PEERS)]
    results = run_parallel([lambda i=i: clients[i].average(
        [xs[i]], key="nat", timeout=60, group_size=PEERS, min_group_size=PEERS)
        for i in range(PEERS)])
    ids = {d.info["peer_id"]: i for i, d in enumerate(swarm.daemons)}
    stack = np.stack([x.numpy() for x in xs])
    for i in range(PEERS):
        out, info = results[i], clients[i].last_round
        assert isinstance(out, list) and info is not None, out
        assert sorted(ids[m] for m in info.members) == list(range(PEERS))
        got = out[0].numpy()
        for start, stop, mask in info.spans:
            assert mask == (1 << PEERS) - 1, info.spans  # nobody was cut off
            np.testing.assert_allclose(got[start:stop], stack[:, start:stop].mean(0),
                                       rtol=1e-5, atol=1e-6)
    relayed_bytes = 0.0
    for i, daemon in enumerate(swarm.daemons):
        metrics = scrape(daemon)
        # each private daemon reduced a part of the vector: its owners' bytes reached it
        assert metrics["moshpitd_reduced_bytes_total"] > ELEMS * 4 / PEERS / 2, (i, metrics)
        state = "private" if i in PRIVATE else "public"
        assert metrics[f'moshpitd_reachability{{state="{state}"}}'] == 1.0
        relayed_bytes += metrics["moshpitd_relay_bytes_total"]
    # what the private daemons received as owners came through the relays
    assert relayed_bytes > 2 * ELEMS * 4 / PEERS


def assert_exact_by_masks(xs: list[torch.Tensor], outs: list[object], clients: list[moshpit.Client],
                          ids: dict[str, int]) -> int:
    """Each span of each result is the mean of the inputs of the members its mask names (its
    own input where the mask is 0); returns how many spans had a member left out."""
    short = 0
    for i, client in enumerate(clients):
        out, info = outs[i], client.last_round
        assert isinstance(out, list) and info is not None, out
        got = out[0].numpy()
        members = [ids[m] for m in info.members]
        for start, stop, mask in info.spans:
            named = [members[b] for b in range(len(members)) if mask >> b & 1] or [i]
            short += len(named) < len(members)
            want = np.mean([xs[n].numpy()[start:stop] for n in named], axis=0)
            np.testing.assert_allclose(got[start:stop], want, rtol=1e-5, atol=1e-6)
    return short


def test_a_relay_that_tampers_is_caught_and_nothing_it_touched_is_averaged(
        tmp_path: Path, swarm_factory: Callable[..., LocalSwarm]) -> None:
    key = tmp_path / "swarm.key"
    key.write_bytes(os.urandom(32).hex().encode() + b"\n")
    key.chmod(0o600)
    marker = tmp_path / "tampered"
    swarm = swarm_factory(3, extra_args=["--swarm-key-file", str(key), "--bandwidth", "100"],
                          env_by_index={0: {"MOSHPITD_FAULT": "tamper-relay",
                                            "MOSHPITD_FAULT_MARKER": str(marker)},
                                        1: {"MOSHPITD_RELAY": "false"},
                                        2: {"MOSHPITD_REACHABILITY": "private",
                                            "MOSHPITD_DIRECT_PATHS": "false"}})
    clients = [moshpit.Client(s) for s in swarm.sockets]
    by = wait_until(lambda: relayed(clients[2]), 20, "daemon 2 relayed")
    assert by["peer_id"] == swarm.daemons[0].info["peer_id"]  # the only one that relays
    xs = [inputs(10 + i) for i in range(3)]
    outs = run_parallel([lambda i=i: clients[i].average(
        [xs[i]], key="tamper", timeout=60, group_size=3, min_group_size=3) for i in range(3)])
    ids = {d.info["peer_id"]: i for i, d in enumerate(swarm.daemons)}
    assert marker.exists()  # the relay did alter frames
    assert assert_exact_by_masks(xs, outs, clients, ids) > 0  # and streams were cut for it
    log = (swarm.daemons[2].log_tail(400) + swarm.daemons[0].log_tail(400)
           + swarm.daemons[1].log_tail(400))
    assert "tamper" in log.lower() or "authentic" in log.lower(), log[-3000:]
