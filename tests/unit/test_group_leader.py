"""The leader's side of matchmaking (moshpitd/matchmaking/leading.py) on its own: Join calls
driven in one event loop, without a matchmaker, a DHT or gRPC."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import pytest

from moshpitd.allreduce.group import Group
from moshpitd.identity import PeerKey
from moshpitd.matchmaking.admission import JoinAdmission
from moshpitd.matchmaking.declaration import Candidate, Declaration
from moshpitd.matchmaking.leading import PROTOCOL_VERSION, GroupLeader
from moshpitd.matchmaking.request import MatchRequest, Self
from moshpitd.matchmaking.signing import PeerAuth, admissions_fault
from moshpitd.proto import moshpit_pb2 as pb

SCHEMA = b"\x5a" * 32
KEY = PeerKey.generate()
ME = Self(KEY.peer_id, "127.0.0.1:10", "127.0.0.1:11", auth=PeerAuth(KEY))
PEERS = [PeerKey.generate() for _ in range(4)]


def pid(peer: int) -> bytes:
    return PEERS[peer].peer_id


def join(peer: int, weight: float = 1.0, signer: PeerKey | None = None) -> pb.JoinRequest:
    """Peer `peer`'s join, signed by its own key unless `signer` is given."""
    request = pb.JoinRequest(group_key="k", peer_id=pid(peer), endpoint="127.0.0.1:1",
                             data_endpoint="127.0.0.1:2", schema_hash=SCHEMA, weight=weight,
                             bandwidth=1.0, protocol_version=PROTOCOL_VERSION, codec="none")
    return PeerAuth(signer or PEERS[peer]).sign_join(request, ME.peer_id)


def leader(joins: list[int], *, target: int = 4, client_mode: bool = False,
           weight: float = 1.0) -> GroupLeader:
    request = MatchRequest("k", SCHEMA, weight, target, client_mode=client_mode,
                           attempt_seconds=5.0, settle_seconds=0.5)
    return GroupLeader(ME, request, lambda: joins.append(1))


async def accepted(calls: AsyncIterator[pb.JoinResponse]) -> None:
    assert (await anext(calls)).code == pb.ACCEPTED


def test_joins_wake_the_owner_and_assembly_reaches_every_follower() -> None:
    async def scenario() -> None:
        woken: list[int] = []
        side = leader(woken, target=3, weight=2.0)
        assert (await anext(side.handle_join(join(1)))).code == pb.NOT_LOOKING  # not open yet
        side.open()
        calls = [side.handle_join(join(1, 3.0)), side.handle_join(join(2, 4.0))]
        for call in calls:
            await accepted(call)
        assert len(woken) == 2 and side.members == {pid(1), pid(2)}
        assert side.last_join > 0
        group = side.assemble()
        assert not side.accepting and not side.followers
        for call in calls:
            done = await anext(call)
            assert done.code == pb.GROUP_ASSEMBLED and Group.from_proto(done.group_info) == group
            # signed by the leader: a follower takes it from us, and only from us
            assert PeerAuth.check_group(done.group_info, group, ME.peer_id, 5.0) is None
            assert PeerAuth.check_group(done.group_info, group, pid(3), 5.0) is not None
        assert [m.weight for m in group.members] == [2.0, 3.0, 4.0]

    asyncio.run(scenario())


def test_a_group_must_carry_each_follower_s_own_join_to_its_leader() -> None:
    """A leader once could list an honest peer that never joined it (the peer's declaration,
    even withdrawn, vouched for its entry): the group stalled on it until the data plane's
    deadline. Now every member checks that each other member signed a join to this leader,
    under this key, as it is listed, within an attempt."""
    async def scenario() -> None:
        side = leader([], target=3)
        side.open()
        calls = [side.handle_join(join(1)), side.handle_join(join(2))]
        for call in calls:
            await accepted(call)
        group = side.assemble()
        info = (await anext(calls[0])).group_info
        assert PeerAuth.check_group(info, group, ME.peer_id, 5.0) is None

        def resigned(edit: Callable[[pb.GroupInfo], object]) -> tuple[pb.GroupInfo, Group]:
            forged = pb.GroupInfo()
            forged.CopyFrom(info)
            edit(forged)
            g = Group.from_proto(forged)
            assert ME.auth is not None
            return ME.auth.sign_group(forged, g), g

        def why(edit: Callable[[pb.GroupInfo], object], now: float | None = None) -> str | None:
            forged, g = resigned(edit)
            return admissions_fault(forged, g, ME.peer_id, 5.0, now)

        # peer 3 never joined: its entry, signed by the leader, is all the group has of it
        def add_peer_3(g: pb.GroupInfo) -> None:
            m = g.members.add()
            m.CopyFrom(g.members[2])
            m.peer_id = pid(3)
        assert "never asked this leader" in str(why(add_peer_3))
        # peer 3's join to another leader, or for another key, does not count either
        other = join(3)
        other.signature = PeerAuth(PEERS[3]).sign_join(join(3), pid(0)).signature
        assert "does not verify" in str(why(lambda g: (add_peer_3(g), g.admissions.add(
            join=other))))
        # a member listed otherwise than it asked
        assert "not listed as it asked" in str(why(lambda g: setattr(g.members[1], "weight",
                                                                     9.0)))
        # a join kept from an attempt long over
        assert "not from this attempt" in str(why(lambda g: None, time.time() + 60.0))

    asyncio.run(scenario())


def test_following_redirects_followers_and_newcomers_until_let_go() -> None:
    async def scenario() -> None:
        side = leader([])
        side.open()
        call = side.handle_join(join(1))
        await accepted(call)
        boss = Candidate(b"\x09" * 20, Declaration("127.0.0.1:9", SCHEMA), 0.0, 1)
        side.follow(boss)
        released = await anext(call)
        assert (released.code, released.suggested_leader_id) == (pb.DISBANDED, boss.peer_id)
        newcomer = await anext(side.handle_join(join(2)))
        assert (newcomer.code, newcomer.suggested_leader) == (pb.NOT_A_LEADER, "127.0.0.1:9")
        side.unfollow(reopen=True)
        assert side.following is None and side.accepting
        side.unfollow(reopen=False)
        assert not side.accepting

    asyncio.run(scenario())


def test_a_client_mode_peer_never_accepts() -> None:
    side = leader([], client_mode=True)
    side.open()
    assert not side.accepting
    side.unfollow(reopen=True)
    assert not side.accepting


def test_it_logs_under_its_own_name(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="moshpitd.matchmaking.leading")
    leader([], weight=0.0).assemble()
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("moshpitd.matchmaking.leading", "group under k has zero total weight")]


def test_a_join_must_prove_its_peer_id() -> None:
    """Unsigned, signed by another key, altered after signing, signed for another leader, or
    replayed: each refused as UNAUTHENTICATED, and nobody joins."""
    async def scenario() -> None:
        side = leader([])
        side.open()
        assert ME.auth is not None
        refused = ME.auth.refused
        unsigned = join(1)
        unsigned.ClearField("signature")
        altered = join(1)
        altered.weight = 100.0
        elsewhere = pb.JoinRequest()
        elsewhere.CopyFrom(join(1))
        PeerAuth(PEERS[1]).sign_join(elsewhere, pid(3))  # for leader 3, not us
        for request in (unsigned, join(1, signer=PEERS[2]), altered, elsewhere):
            answer = await anext(side.handle_join(request))
            assert answer.code == pb.UNAUTHENTICATED, (answer.code, answer.message)
        assert not side.followers and ME.auth.refused == refused + 4
        genuine = join(1)
        call = side.handle_join(genuine)
        await accepted(call)
        side.followers.clear()  # it left; the same signed request again is a replay
        replayed = await anext(side.handle_join(genuine))
        assert replayed.code == pb.UNAUTHENTICATED and "replay" in replayed.message

    asyncio.run(scenario())


def test_a_join_takes_a_slot_only_once_it_proved_its_peer_id() -> None:
    """Joins claiming a victim's id, signed by another key, hold none of the victim's share:
    the victim's own join still gets in."""
    async def scenario() -> None:
        side = leader([])
        side.open()
        joins = JoinAdmission(total=4, per_peer=1)
        for _ in range(8):
            forged = await anext(side.handle_join(join(1, signer=PEERS[2]), b"", joins))
            assert forged.code == pb.UNAUTHENTICATED
        assert joins.held == 0 and not joins.refused
        call = side.handle_join(join(1), b"", joins)
        await accepted(call)
        assert joins.held == 1
        await call.aclose()  # the follower hangs up: its slot is freed
        assert joins.held == 0

    asyncio.run(scenario())


def test_a_leader_caps_a_follower_s_declared_rate_at_what_its_streams_carried() -> None:
    """A follower that declares 1e12 Mbit/s would own the largest span the share cap allows.
    A leader that timed its streams lists it at most at that rate (scaled for its link's
    streams), and every member still takes the group: a leader may lower a rate it lists,
    never raise one."""
    from dataclasses import replace

    from moshpitd.allreduce.rates import PeerRates

    async def scenario() -> None:
        rates = PeerRates()
        rates.observe(pid(1), 1e6)  # 1 MB/s: 8 Mbit/s on one stream
        me = replace(ME, rates=rates)
        request = MatchRequest("k", SCHEMA, 1.0, 3, attempt_seconds=5.0, settle_seconds=0.5)
        side = GroupLeader(me, request, lambda: None)
        side.open()
        liar = join(1)
        liar.bandwidth = 1e12
        liar = PeerAuth(PEERS[1]).sign_join(liar, ME.peer_id)
        calls = [side.handle_join(liar), side.handle_join(join(2))]
        for call in calls:
            await accepted(call)
        group = side.assemble()
        by_id = {m.peer_id: m.bandwidth for m in group.members}
        assert by_id[pid(1)] == rates.cap_mbit(pid(1), 3) == 2.0 * 2 * 8.0
        assert by_id[pid(2)] == 1.0 and rates.capped == 1  # unmeasured: as declared
        info = (await anext(calls[1])).group_info
        assert PeerAuth.check_group(info, group, ME.peer_id, 5.0) is None
        assert admissions_fault(info, group, ME.peer_id, 5.0) is None
        raised = Group.from_proto(info)
        raised = replace(raised, members=tuple(replace(m, bandwidth=2e12) if m.peer_id == pid(1)
                                               else m for m in raised.members))
        assert "not listed as it asked" in (admissions_fault(info, raised, ME.peer_id, 5.0)
                                            or "")

    asyncio.run(scenario())
