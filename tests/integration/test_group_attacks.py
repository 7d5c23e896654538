"""What a swarm-key holder can no longer do to groups, on real daemons: lead with a GroupInfo it
altered (attacks 8 and 9) or flood a leader with joins (attack 3, its bounds).

One swarm of four daemons, all holding the swarm key. d0 is the attacker as a leader: its
daemon alters every group it leads (MOSHPITD_FAULT=tamper-group, one alteration per group, in
turn). d1 holds at most 2 joins at once, 1 per peer id. A test passes when the honest peers'
results are the exact mean over the honest members only, every element counted, and the
attacker is cut out with a log line saying why; never merely when a round completed.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import moshpit
from moshpitd.allreduce.layout import TensorSpec, schema_hash
from moshpitd.auth import SwarmKey
from moshpitd.faults import TAMPERINGS
from moshpitd.identity import PeerKey
from moshpitd.launcher import LocalSwarm
from moshpitd.matchmaking.declaration import Declaration
from moshpitd.matchmaking.leading import PROTOCOL_VERSION
from moshpitd.proto import moshpit_pb2 as pb
from moshpitd.transport.grpc_server import ChannelPool
from moshpitd.transport.security import Security
from tests.integration.dht_wire import RawDHT, hostport
from tests.integration.helpers import run_parallel, wait_until
from tests.integration.test_grid import check_round
from tests.integration.test_identity_attacks import metrics, swarm_key

ELEMS = 20_000
WHY = {  # what an honest follower logs when it leaves each altered group
    "codec": "its codec is 'int8', we asked for 'none'",
    "bandwidth": "bandwidth differ from its declaration",
    "phantom": "has no signed declaration under the key",
    "weight": "lie more than 1e+12 apart",
}


Swarm = tuple[LocalSwarm, SwarmKey, Path]  # the daemons, the swarm key, the fault's marker


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    tmp = tmp_path_factory.mktemp("group-attacks")
    key, args = swarm_key(tmp)
    marker = tmp / "tampered"
    env = {0: {"MOSHPITD_FAULT": "tamper-group", "MOSHPITD_FAULT_MARKER": str(marker)},
           1: {"MOSHPITD_JOIN_MAX_IN_FLIGHT": "2", "MOSHPITD_JOIN_MAX_PER_PEER": "1"}}
    s = LocalSwarm(4, workdir=tmp / "swarm", extra_args=args, env_by_index=env)
    try:
        yield s.start(), key, marker
    finally:
        s.stop()


def inputs(swarm: LocalSwarm, seed: int) -> dict[str, torch.Tensor]:
    return {d.info["peer_id"]: torch.randn(ELEMS, generator=torch.Generator().manual_seed(
        seed * 10 + i)) for i, d in enumerate(swarm.daemons)}


def honest_round(swarm: LocalSwarm, key: str, honest: list[int], seed: int,
                 **kw: Any) -> None:
    """Each honest trainer averages; each result must be the exact mean over exactly the
    honest peers, every element averaged."""
    xs = inputs(swarm, seed)
    ids = [swarm.daemons[i].info["peer_id"] for i in honest]

    def one(i: int) -> set[str]:
        me = swarm.daemons[i].info["peer_id"]
        with moshpit.Client(swarm.daemons[i].socket) as c:
            (out,) = c.average([xs[me]], key=key, timeout=20, **kw)
            info = c.last_round
            assert info is not None and info.fully_averaged, info
            return check_round(out, info, me, xs, dict.fromkeys(xs, 1.0))
    groups = run_parallel([lambda i=i: one(i) for i in honest])
    assert all(g == set(ids) for g in groups), groups


def log_lines(swarm: LocalSwarm, i: int) -> list[str]:
    return swarm.daemons[i].log_path.read_text().splitlines()


def test_followers_leave_a_group_their_leader_altered(
        swarm: Swarm) -> None:
    """Attacks 8 and 9. The attacker declares first, so every honest peer asks it to lead,
    and it sends each group altered: codec int8 where all asked for none; every follower's
    bandwidth 0 (which handed the leader the whole vector); a member nobody declared; its own
    weight 1e308 (which overflowed reducers' sums, and honest trainers were told their own
    values held NaN or Inf). Each time the honest peers leave it and average among
    themselves."""
    s, key, marker = swarm
    rogue = s.daemons[0].info["peer_id"]
    attacker_runs: list[threading.Thread] = []
    with RawDHT(key) as raw:
        dht = hostport(s.daemons[1].dht)
        for n, how in enumerate(TAMPERINGS):
            round_key = f"tampered-{how}"
            before = [len(log_lines(s, i)) for i in range(4)]

            def attacker(k: str = round_key) -> None:
                with moshpit.Client(s.daemons[0].socket) as c, \
                        contextlib.suppress(moshpit.MoshpitError):
                    c.average([torch.ones(ELEMS)], key=k, timeout=8, group_size=5)
            attacker_runs.append(threading.Thread(target=attacker))
            attacker_runs[-1].start()
            wait_until(lambda k=round_key: any(  # type: ignore[misc]
                bytes(r[0]).hex() == rogue and (d := Declaration.unpack(r[1])) is not None
                and not d.withdrawn for r in raw.find_subs(dht, k)), 10,
                "the attacker's declaration", poll=0.02)
            honest_round(s, round_key, [1, 2, 3], seed=n, group_size=5)  # room for a phantom
            assert marker.read_text() == how  # the attacker did lead, and altered the group
            for i in (1, 2, 3):
                left = [line for line in log_lines(s, i)[before[i]:]
                        if "left the group" in line and f"that {rogue[:8]} led" in line]
                assert left and WHY[how] in left[0], (i, how, left)
                assert "NaN or Inf" not in "\n".join(log_lines(s, i)[before[i]:])
    for t in attacker_runs:
        t.join(30)
    for d in s.daemons:
        assert d.alive() and "Traceback" not in d.log_path.read_text()


def ghost_declaration(schema: bytes) -> bytes:
    return Declaration("127.0.0.1:9", schema, data_endpoint="127.0.0.1:9").pack()


def ghost_join(pool: ChannelPool, endpoint: str, key: str, ghost: bytes, schema: bytes) -> Any:
    """A Join as the ghost declared itself: endpoints where nothing listens."""
    return pool.join(endpoint, pb.JoinRequest(
        group_key=key, peer_id=ghost, endpoint="127.0.0.1:9", schema_hash=schema, weight=1.0,
        protocol_version=PROTOCOL_VERSION, data_endpoint="127.0.0.1:9", bandwidth=1.0,
        codec="none"), timeout=30)


def test_a_join_flood_is_bounded(swarm: Swarm) -> None:
    """Attack 3, its bounds. d1 leads (min 4 members). Ten joins under made-up peer ids are
    refused: none declared itself. Then ghosts that did declare, signed, with endpoints where
    nothing listens: d1 holds two of their joins (join_max_in_flight=2), refuses a third, and
    refuses a second join from one ghost (join_max_per_peer=1). Once the ghosts hang up, the
    honest peers average, exactly, among themselves."""
    s, key, _ = swarm
    round_key = "join-flood"
    schema = schema_hash([TensorSpec("float32", (ELEMS,), 0)])
    ghosts = [PeerKey.generate() for _ in range(3)]
    with RawDHT(key) as raw:
        for d in s.daemons:
            for g in ghosts:
                assert raw.store_sub(hostport(d.dht), round_key, g, ghost_declaration(schema))
            raw.leave(hostport(d.dht))
    leader = s.daemons[1]
    xs = inputs(s, seed=9)
    got: dict[str, Any] = {}

    def lead() -> None:
        with moshpit.Client(leader.socket) as c:
            (got["out"],) = c.average([xs[leader.info["peer_id"]]], key=round_key, timeout=20,
                                      group_size=8, min_group_size=4)
            got["info"] = c.last_round
    leading = threading.Thread(target=lead)
    leading.start()

    async def flood() -> list[pb.JoinResponse]:
        pool = ChannelPool(security=Security(key))
        endpoint = leader.info["grpc"]
        held = []
        try:
            for _ in range(10):  # made-up peer ids, nothing declared
                call = ghost_join(pool, endpoint, round_key, PeerKey.generate().peer_id, schema)
                answer = await call.read()
                assert answer.code == pb.BAD_REQUEST, answer
                assert "no signed declaration" in answer.message, answer
            for g in ghosts[:2]:
                held.append(ghost_join(pool, endpoint, round_key, g.peer_id, schema))
                first = await held[-1].read()
                if first.code != pb.ACCEPTED:  # d1 had not opened its attempt yet
                    assert first.code == pb.NOT_LOOKING, first
                    held[-1] = ghost_join(pool, endpoint, round_key, g.peer_id, schema)
                    assert (await held[-1].read()).code == pb.ACCEPTED
            out = []
            for peer in (ghosts[2].peer_id, ghosts[0].peer_id):
                out.append(await ghost_join(pool, endpoint, round_key, peer, schema).read())
            return out
        finally:
            for call in held:
                call.cancel()
            await pool.close()

    wait_until(lambda: round_key in moshpit.Client(leader.socket).status()["status"][
        "active_keys"], 10, "d1 matchmaking")
    third, again = asyncio.run(flood())
    assert third.code == pb.GROUP_FULL and "join_max_in_flight" in third.message, third
    assert again.code == pb.GROUP_FULL and "join_max_per_peer" in again.message, again
    m = metrics(leader)
    assert m['moshpitd_joins_refused_total{limit="in_flight"}'] >= 1, m
    assert m['moshpitd_joins_refused_total{limit="per_peer"}'] >= 1, m

    others = [0, 2, 3]
    ids = [d.info["peer_id"] for d in s.daemons]

    def follow(i: int) -> set[str]:
        with moshpit.Client(s.daemons[i].socket) as c:
            (out,) = c.average([xs[ids[i]]], key=round_key, timeout=20, group_size=8,
                               min_group_size=4)
            return check_round(out, c.last_round, ids[i], xs, dict.fromkeys(ids, 1.0))
    groups = run_parallel([lambda i=i: follow(i) for i in others])
    leading.join(30)
    assert "info" in got, "the leader's round did not finish"
    assert got["info"].fully_averaged, got["info"]
    groups.append(check_round(got["out"], got["info"], ids[1], xs, dict.fromkeys(ids, 1.0)))
    assert all(g == set(ids) for g in groups), groups  # no ghost among the members
