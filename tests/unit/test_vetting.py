"""What a follower checks of its GroupInfo and a leader of a joiner, and the Join bounds."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import replace
from typing import Any

import pytest
from kademlia.utils import digest

from moshpitd.allreduce.group import Group, GroupMember
from moshpitd.dht.network import SubRecord
from moshpitd.dht.records import Proof, RecordVerifier, remaining, sign
from moshpitd.faults import TAMPERINGS, tampered
from moshpitd.identity import PeerKey
from moshpitd.matchmaking.admission import SLOT_MARGIN, JoinAdmission
from moshpitd.matchmaking.declaration import MAX_TTL, Declaration
from moshpitd.matchmaking.request import MatchRequest
from moshpitd.matchmaking.vetting import (
    READ_GAP,
    DeclarationBook,
    entries_fault,
    shape_fault,
    weights_fault,
)
from moshpitd.proto import moshpit_pb2 as pb

SCHEMA = b"\x01" * 16
REQ = MatchRequest("k", SCHEMA, 1.0, 4, attempt_seconds=5.0, settle_seconds=0.5)


def member(i: int, **kw: Any) -> GroupMember:
    return GroupMember(bytes([i]) * 20, f"127.0.0.1:{100 + i}", kw.pop("weight", 1.0),
                       data_endpoint=f"127.0.0.1:{200 + i}", **kw)


def declaration(m: GroupMember) -> Declaration:
    return Declaration(m.endpoint, SCHEMA, m.client_mode, m.data_endpoint, m.weight,
                       m.bandwidth)


GROUP = Group(b"\x07" * 16, "k", 0, SCHEMA, (member(1), member(2), member(3)))
DECLARED = {m.peer_id: declaration(m) for m in GROUP.members}


def vet(group: Group, me: int = 2) -> str | None:
    return shape_fault(group, REQ, bytes([me]) * 20) or entries_fault(group, REQ,
                                                                      DECLARED.get)


def test_an_honest_group_passes() -> None:
    assert vet(GROUP) is None


@pytest.mark.parametrize("how, why", [
    ("codec", "its codec is 'int8', we asked for 'none'"),
    ("bandwidth", "bandwidth differ from its declaration"),
    ("phantom", "has no signed declaration under the key"),
    ("weight", "lie more than 1e+12 apart"),
])
def test_every_tampering_is_caught(how: str, why: str) -> None:
    assert set(TAMPERINGS) >= {how}
    got = vet(tampered(GROUP, how))
    assert got is not None and why in got, got


@pytest.mark.parametrize("change, why", [
    (lambda g: replace(g, key="other"), "it is for key 'other'"),
    (lambda g: replace(g, schema_hash=b"\x02" * 16),
     "tensors, codec, aggregation or data encryption differ"),
    (lambda g: replace(g, group_id=b"short"), "group id is malformed"),
    (lambda g: replace(g, members=g.members * 2), "members, we asked for at most 4"),
    (lambda g: replace(g, members=g.members[:1] * 2), "listed twice"),
    (lambda g: replace(g, members=g.members[:1]), "it has 1 members"),
    (lambda g: replace(g, members=(g.members[0], g.members[2])), "we are not in it"),
    (lambda g: replace(g, members=(replace(g.members[0], weight=math.nan), *g.members[1:])),
     "not a finite number"),
    (lambda g: replace(g, members=tuple(replace(m, weight=1e308) for m in g.members)),
     "total overflows"),
    (lambda g: replace(g, members=(*g.members[:2], replace(g.members[2], data_endpoint="x:1"))),
     "data endpoint differ"),
    (lambda g: replace(g, members=(g.members[0], replace(g.members[1], weight=2.0),
                                   g.members[2])), "weight differ"),  # our own entry
])
def test_a_bad_group_is_named(change: Any, why: str) -> None:
    got = vet(change(GROUP))
    assert got is not None and why in got, got


def test_weights() -> None:
    assert weights_fault([0.0, 0.0]) is None  # a round skipped by every member alike
    assert weights_fault([0.0, 1e-3, 1e9]) is None
    assert weights_fault([1e-3, 1e10]) is not None  # 1e13 apart
    assert weights_fault([-1.0, 1.0]) is not None and weights_fault([math.inf]) is not None


def test_the_book_keeps_withdrawn_declarations_and_reads_again_when_a_check_fails() -> None:
    reads = 0
    later: dict[bytes, SubRecord] = {}

    async def read() -> dict[bytes, SubRecord]:
        nonlocal reads
        reads += 1
        await asyncio.sleep(0.01)
        return later

    async def main() -> None:
        book = DeclarationBook(read, (b"\x09" * 20, Declaration("me:1", SCHEMA)))
        m = member(1)
        book.absorb({m.peer_id: SubRecord(declaration(m).pack(), 5, 1.0)})
        book.absorb({m.peer_id: SubRecord(declaration(m).withdraw().pack(), 6, 1.0)})
        book.absorb({m.peer_id: SubRecord(b"", 7, 1.0)})  # not a declaration: ignored
        got = book.get(m.peer_id)
        assert got is not None and got.withdrawn and got.endpoint == m.endpoint
        assert book.get(b"\x09" * 20) == Declaration("me:1", SCHEMA)
        # an unknown member: one lookup, shared by every check at that moment
        n = member(2)
        later[n.peer_id] = SubRecord(declaration(n).pack(), 1, 1.0)

        def check(get: Any) -> str | None:
            return None if get(n.peer_id) is not None else "unknown"
        assert await asyncio.gather(*(book.vouched(check) for _ in range(5))) == [None] * 5
        assert reads == 1
        assert await book.vouched(lambda get: "never") == "never" and reads == 2

    asyncio.run(main())


def test_a_flood_of_undeclared_joiners_costs_one_read_per_gap() -> None:
    """Each join from a peer we hold no declaration of reads the key again: 200 of them over
    half a second (one identity once sent 283 a second) cost a read per READ_GAP, not each
    their own."""
    reads = 0

    async def read() -> dict[bytes, SubRecord]:
        nonlocal reads
        reads += 1
        return {}

    async def main() -> None:
        book = DeclarationBook(read)
        loop = asyncio.get_running_loop()
        began = loop.time()
        checks = []
        for _ in range(200):
            checks.append(asyncio.ensure_future(book.vouched(lambda get: "unknown")))
            await asyncio.sleep(0.0025)
        assert await asyncio.gather(*checks) == ["unknown"] * 200
        spent = loop.time() - began
        assert reads <= spent / READ_GAP + 2, (reads, spent)
        assert book.reads == reads

    asyncio.run(main())


def test_join_admission_bounds_per_peer_and_in_total() -> None:
    now = [0.0]
    joins = JoinAdmission(total=3, per_peer=2, clock=lambda: now[0])
    a, b, c = b"a" * 20, b"b" * 20, b"c" * 20
    first, second = joins.admit(a, 10.0), joins.admit(a, 10.0)
    assert isinstance(first, int) and isinstance(second, int)
    why = joins.admit(a, 10.0)
    assert isinstance(why, str) and "join_max_per_peer" in why
    assert isinstance(joins.admit(b, 10.0), int)
    why = joins.admit(c, 10.0)
    assert isinstance(why, str) and "join_max_in_flight" in why
    joins.release(first)
    joins.release(first)  # twice: the second does nothing
    assert isinstance(joins.admit(c, 10.0), int) and joins.held == 3
    assert dict(joins.refused) == {"per_peer": 1, "in_flight": 1}


def test_join_slots_are_freed_at_their_deadline_whatever_the_call_does() -> None:
    """A caller that stops reading (an HTTP/2 window of 0) stalls its handler's write; its
    slot is free anyway once the leader's attempt and the margin are over."""
    now = [0.0]
    joins = JoinAdmission(total=2, per_peer=2, clock=lambda: now[0])
    stuck = [joins.admit(b"x" * 20, 4.0) for _ in range(2)]
    assert all(isinstance(s, int) for s in stuck)
    assert isinstance(joins.admit(b"y" * 20, 4.0), str)
    now[0] = 4.0 + SLOT_MARGIN - 0.01
    assert isinstance(joins.admit(b"y" * 20, 4.0), str)
    now[0] = 4.0 + SLOT_MARGIN
    assert joins.held == 0 and joins.expired == 2
    late = joins.admit(b"y" * 20, 4.0)
    assert isinstance(late, int)
    for slot in stuck:  # the stalled handlers finally return: nothing of others' is freed
        assert isinstance(slot, int)
        joins.release(slot)
    assert joins.held == 1


def test_the_book_looks_in_the_local_replica_before_the_network() -> None:
    reads = 0
    m = member(3)
    held = {m.peer_id: SubRecord(declaration(m).pack(), 1, 1.0)}

    async def read() -> dict[bytes, SubRecord]:
        nonlocal reads
        reads += 1
        return {}

    async def main() -> None:
        book = DeclarationBook(read, None, lambda: held)
        assert await book.vouched(lambda get: None if get(m.peer_id) else "unknown") is None
        assert reads == 0  # a replica of the key already held it: no lookup
        assert await book.vouched(lambda get: None if get(b"x" * 20) else "unknown") \
            == "unknown" and reads == 1

    asyncio.run(main())


def test_a_leader_may_lower_a_declared_rate_never_raise_it() -> None:
    """Rates a leader capped at what a follower's streams carried (allreduce/rates.py) pass;
    a rate above the declaration is an altered entry."""
    lowered = replace(GROUP, members=(GROUP.members[0], replace(GROUP.members[1], bandwidth=0.5),
                                      GROUP.members[2]))
    assert vet(lowered) is None
    raised = replace(GROUP, members=(GROUP.members[0], replace(GROUP.members[1], bandwidth=1.5),
                                     GROUP.members[2]))
    assert "bandwidth differ from its declaration" in (vet(raised) or "")


def test_a_join_carries_its_signed_declaration_and_only_a_signed_one_is_taken() -> None:
    """A leader takes the declaration a join carries (its writer's DHT record) once its
    signature holds: no lookup. Altered bytes, another writer's key or a lifetime past the
    declarations' bound are not taken, and the book reads the key as before."""
    key, other = PeerKey.generate(), PeerKey.generate()
    dkey, version = digest("k"), time.time_ns()
    decl = Declaration("me:1", SCHEMA, data_endpoint="me:2", weight=1.0, bandwidth=1.0)
    verifier = RecordVerifier()

    checks = []

    def verify(peer: bytes, value: bytes, ver: int, proof: Proof) -> SubRecord | None:
        checks.append(peer)
        ok = verifier.check(dkey, peer, value, ver, proof.ttl, proof)
        return None if ok is None else SubRecord(value, ver, remaining(ver, ok, proof.ttl))

    def join(value: bytes, ttl: float = 5.0, signer: PeerKey = key) -> pb.JoinRequest:
        proof = sign(signer, dkey, decl.pack(), version, ttl)
        return pb.JoinRequest(peer_id=key.peer_id, public_key=signer.public, declaration=value,
                              declaration_version=version, declaration_ttl=proof.ttl,
                              declaration_signature=proof.signature)

    async def read() -> dict[bytes, SubRecord]:
        return {}

    book = DeclarationBook(read, verify=verify)
    altered = decl.pack().replace(b"me:1", b"me:9")
    for bad in (join(altered), join(decl.pack(), signer=other),
                join(decl.pack(), ttl=MAX_TTL + 1)):
        book.carried(bad)
        assert book.get(key.peer_id) is None
    book.carried(join(decl.pack()))
    assert book.get(key.peer_id) == decl
    before = len(checks)
    book.carried(join(decl.pack()))  # nothing newer than what the book holds: not checked
    assert len(checks) == before
