"""What a swarm-key holder can no longer do beyond the DHT, on real daemons: lead with a
GroupInfo it altered (attacks 8 and 9), flood a leader with joins (attack 3, its bounds),
capture joiners with one donor far ahead (attack 4), or, as a trainer, exhaust its daemon by
attaching buffers (attack 7).

One swarm of four daemons, all holding the swarm key. d0 is the attacker: its daemon alters
every group it leads (MOSHPITD_FAULT=tamper-group, one alteration per group, in turn), and its
trainer publishes a poisoned state. d1 holds at most 2 joins at once, 1 per peer id. A test
passes when the honest peers' results are correct (the exact mean over the honest members
only, every element counted; the honest donor's state) and the attacker is cut out with a
clear error or log line; never merely when a call completed.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

import moshpit
from bench.attacks.dht_wire import RawDHT, hostport
from moshpitd.allreduce.layout import TensorSpec, schema_hash
from moshpitd.auth import SwarmKey
from moshpitd.faults import TAMPERINGS
from moshpitd.identity import PeerKey
from moshpitd.ipc.schema import MAX_BUFFERS
from moshpitd.launcher import DaemonProcess, LocalSwarm
from moshpitd.matchmaking.declaration import Declaration
from moshpitd.matchmaking.leading import PROTOCOL_VERSION
from moshpitd.matchmaking.signing import PeerAuth
from moshpitd.proto import moshpit_pb2 as pb
from moshpitd.transport.grpc_server import ChannelPool
from moshpitd.transport.security import Security
from tests.integration.helpers import run_parallel, scrape, wait_until
from tests.integration.test_grid import check_round
from tests.integration.test_identity_attacks import swarm_key

T = TypeVar("T")
ELEMS = 20_000
WHY = {  # what an honest follower logs when it leaves each altered group
    "codec": "its codec is 'int8', we asked for 'none'",
    # its entry differs from the follower's signed join (and from its declaration)
    "bandwidth": "is not listed as it asked to join",
    # a member with no signed join to this leader (nor a declaration)
    "phantom": "never asked this leader to lead it",
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


def run_in_thread(fn: Callable[[], T]) -> Future[T]:
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(fn)
    finally:
        pool.shutdown(wait=False)


def log_lines(swarm: LocalSwarm, i: int) -> list[str]:
    return swarm.daemons[i].log_path.read_text().splitlines()


def test_followers_leave_a_group_their_leader_altered(
        swarm: Swarm) -> None:
    """Attacks 8 and 9. The attacker declares first, so every honest peer asks it to lead,
    and it sends each group altered: codec int8 where all asked for none; every follower's
    rate raised a thousandfold (it may lower one, never raise it); a member nobody declared;
    its own weight 1e308 (which overflowed reducers' sums, and honest trainers were told their
    own values held NaN or Inf). Each time the honest peers leave it and average among
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


def ghost_declaration(schema: bytes, client_mode: bool = False) -> bytes:
    return Declaration("127.0.0.1:9", schema, client_mode,
                       data_endpoint="127.0.0.1:9").pack()


def ghost_join(pool: ChannelPool, endpoint: str, key: str, ghost: PeerKey, schema: bytes,
               leader: bytes, client_mode: bool = False) -> Any:
    """A Join as the ghost declared itself (endpoints where nothing listens), signed by its
    own key for `leader`: the identity is the ghost's, only its endpoints are empty."""
    return pool.join(endpoint, PeerAuth(ghost).sign_join(pb.JoinRequest(
        group_key=key, peer_id=ghost.peer_id, endpoint="127.0.0.1:9", schema_hash=schema,
        weight=1.0, protocol_version=PROTOCOL_VERSION, data_endpoint="127.0.0.1:9",
        bandwidth=1.0, codec="none", client_mode=client_mode), leader), timeout=30)


def test_a_join_flood_is_bounded(swarm: Swarm) -> None:
    """Attack 3, its bounds. d1 averages under two keys. Under the first, ten joins under
    made-up peer ids are refused: none declared itself; so is a ghost that declared itself at
    endpoints where nothing listens, since it does not answer d1's probe. Under the second,
    ghosts that declared themselves in client mode (which takes no calls, so no probe): d1
    holds two of their joins (join_max_in_flight=2, over all keys), refuses a third ghost,
    and refuses a second join from one ghost (join_max_per_peer=1). Once the ghosts hang
    up, the honest peers average under the first key, exactly, among themselves."""
    s, key, _ = swarm
    round_key, hold_key = "join-flood", "join-hold"
    schema = schema_hash([TensorSpec("float32", (ELEMS,), 0)], encrypted=True,  # a swarm key
                         checked=True)
    ghosts = [PeerKey.generate() for _ in range(3)]
    unreachable = PeerKey.generate()
    with RawDHT(key) as raw:
        for d in s.daemons:
            for g in ghosts:
                assert raw.store_sub(hostport(d.dht), hold_key, g,
                                     ghost_declaration(schema, client_mode=True))
            assert raw.store_sub(hostport(d.dht), round_key, unreachable,
                                 ghost_declaration(schema))
            raw.leave(hostport(d.dht))
    leader = s.daemons[1]
    honest = [1, 2, 3]
    ids = [s.daemons[i].info["peer_id"] for i in honest]
    xs = inputs(s, seed=9)

    def average(i: int, k: str, **kw: Any) -> set[str]:
        with moshpit.Client(s.daemons[i].socket) as c:
            (out,) = c.average([xs[s.daemons[i].info["peer_id"]]], key=k, **kw)
            assert c.last_round is not None and c.last_round.fully_averaged, c.last_round
            return check_round(out, c.last_round, s.daemons[i].info["peer_id"], xs,
                               dict.fromkeys(xs, 1.0))

    def hold() -> None:  # a group the ghosts may join, that can never assemble
        with contextlib.suppress(moshpit.GroupNotFound):
            average(1, hold_key, timeout=4, group_size=8, min_group_size=8)
    holding = threading.Thread(target=hold)
    holding.start()
    leading = run_in_thread(lambda: average(1, round_key, timeout=20, group_size=4,
                                            min_group_size=3))

    async def flood() -> list[pb.JoinResponse]:
        pool = ChannelPool(security=Security(key))
        endpoint, lead = leader.info["grpc"], bytes.fromhex(leader.info["peer_id"])
        held = []
        try:
            for _ in range(10):  # made-up peer ids, nothing declared
                call = ghost_join(pool, endpoint, round_key, PeerKey.generate(), schema, lead)
                answer = await call.read()
                assert answer.code == pb.BAD_REQUEST, answer
                assert "no signed declaration" in answer.message, answer
            answer = await ghost_join(pool, endpoint, round_key, unreachable, schema,
                                      lead).read()
            assert answer.code == pb.BAD_REQUEST and "probe" in answer.message, answer
            for g in ghosts[:2]:
                held.append(ghost_join(pool, endpoint, hold_key, g, schema, lead, True))
                assert (await held[-1].read()).code == pb.ACCEPTED
            # a third ghost; then a second join from a held ghost, under the other key (under
            # the same key it is a DUPLICATE_PEER, refused before it takes a slot)
            return [await ghost_join(pool, endpoint, k, peer, schema, lead, True).read()
                    for k, peer in ((hold_key, ghosts[2]), (round_key, ghosts[0]))]
        finally:
            for call in held:
                call.cancel()
            await pool.close()

    with moshpit.Client(leader.socket) as c:
        wait_until(lambda: {round_key, hold_key} <= set(c.status()["status"]["active_keys"]),
                   10, "d1 matchmaking under both keys")
    third, again = asyncio.run(flood())
    assert third.code == pb.GROUP_FULL and "join_max_in_flight" in third.message, third
    assert again.code == pb.GROUP_FULL and "join_max_per_peer" in again.message, again
    m = scrape(leader)
    assert m['moshpitd_joins_refused_total{limit="in_flight"}'] >= 1, m
    assert m['moshpitd_joins_refused_total{limit="per_peer"}'] >= 1, m

    groups = run_parallel([lambda i=i: average(i, round_key, timeout=20, group_size=4,
                                               min_group_size=3) for i in honest[1:]])
    groups.append(leading.result(30))
    assert all(g == set(ids) for g in groups), groups  # no ghost among the members
    holding.join(30)


STATE_RUN = "run/state"


def trainer_state(value: float, n: int = 1000) -> list[torch.Tensor]:
    return [torch.full((n,), value), torch.full((3,), value, dtype=torch.float64)]


def test_a_joiner_is_not_captured_by_one_donor_far_ahead(swarm: Swarm) -> None:
    """Attack 4: a trainer publishes 666/-666 at local step 10^9 as version 2^63-1, through
    the ordinary client API. Before, every joiner took it, even after honest donors published
    newer steps. Now a version that no other peer's signed donor record comes near is
    refused, and the joiner takes the honest state."""
    s = swarm[0]
    with contextlib.ExitStack() as stack:
        attacker, joiner, honest, other = (stack.enter_context(moshpit.Client(d.socket))
                                           for d in s.daemons)
        joins_honestly(s, honest, other, attacker, joiner)


def joins_honestly(swarm: LocalSwarm, honest: moshpit.Client, other: moshpit.Client,
                   attacker: moshpit.Client, joiner: moshpit.Client) -> None:
    honest.publish_state(STATE_RUN, trainer_state(41.0), {"local_step": 41}, version=41)
    attacker.publish_state(STATE_RUN, [torch.full((1000,), 666.0), torch.full((3,), -666.0,
                           dtype=torch.float64)], {"local_step": 10**9}, version=2**63 - 1)
    other.publish_state(STATE_RUN, trainer_state(42.0), {"local_step": 42}, version=42)
    tensors, meta = joiner.download_state(STATE_RUN, timeout=20)
    assert meta == {"local_step": 42}
    for got, want in zip(tensors, trainer_state(42.0), strict=True):
        assert torch.equal(got, want)
    log = swarm.daemons[1].log_path.read_text()
    assert f"announces version {2**63 - 1}, beyond what any other peer's record shows" in log
    # the honest donor moves on: the joiner follows it, the attacker's version stays refused
    other.publish_state(STATE_RUN, trainer_state(43.0), {"local_step": 43}, version=43)
    tensors, meta = joiner.download_state(STATE_RUN, timeout=20)
    assert meta == {"local_step": 43} and torch.equal(tensors[0], trainer_state(43.0)[0])
    assert joiner.last_download is not None and joiner.last_download["version"] == 43


def memfd_maps(daemon: DaemonProcess) -> int:
    """Trainers' buffers the daemon has mapped (each a memfd the client names 'moshpit')."""
    with open(f"/proc/{daemon.proc.pid}/maps") as f:
        return sum(1 for line in f if "memfd:moshpit" in line)


def fds(daemon: DaemonProcess) -> int:
    return len(list(Path(f"/proc/{daemon.proc.pid}/fd").iterdir()))


def test_attaching_without_end_is_bounded(swarm: Swarm) -> None:
    """Attack 7: a trainer attaches buffer 1 again and again. Before, every old mapping was
    kept until the session closed, and 20k of them exhausted the daemon; rounds then came
    back "ok" with local values only. Now a replaced buffer no request uses is unmapped at
    once (buffer ids were already bounded), and rounds stay exact."""
    s = swarm[0]
    d1 = s.daemons[1]  # an honest daemon, its trainer the attacker
    # the earlier tests' sessions are closed: their buffers go once the daemon sees that
    wait_until(lambda: memfd_maps(d1) == 0, 10, "earlier sessions' buffers unmapped")
    before_maps, before_fds = 0, fds(d1)
    with moshpit.Client(d1.socket) as attacker:
        for _ in range(300):
            attacker._attach(1, 4096)
        assert memfd_maps(d1) == before_maps + 1  # the latest mapping of buffer 1 only
        assert fds(d1) <= before_fds + 2
        for bid in range(MAX_BUFFERS):
            attacker._attach(bid, 4096)
            attacker._attach(bid, 4096)
        assert memfd_maps(d1) == before_maps + MAX_BUFFERS
        with pytest.raises(moshpit.InvalidRequest, match=f"0..{MAX_BUFFERS - 1}"):
            attacker._attach(MAX_BUFFERS, 4096)
        # trainers on other sessions of that daemon still average exactly
        ids = [d.info["peer_id"] for d in s.daemons[1:]]
        xs = {pid: torch.randn(5000, generator=torch.Generator().manual_seed(i))
              for i, pid in enumerate(ids)}

        def one(i: int) -> set[str]:
            with moshpit.Client(s.daemons[i + 1].socket) as c:
                (out,) = c.average([xs[ids[i]]], key="after-attaches", timeout=20,
                                   group_size=3)
                assert c.last_round is not None and c.last_round.fully_averaged
                return check_round(out, c.last_round, ids[i], xs, dict.fromkeys(ids, 1.0))
        groups = run_parallel([lambda i=i: one(i) for i in range(3)])
        assert all(g == set(ids) for g in groups), groups
    wait_until(lambda: memfd_maps(d1) == 0, 10, "the sessions' buffers unmapped")
    assert d1.alive() and "Traceback" not in d1.log_path.read_text()
