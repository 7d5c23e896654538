"""Liveness and Vitals on a fake probe and clock: which declared peers count, and what a flood
of them costs."""

from __future__ import annotations

import asyncio

from moshpitd.matchmaking.declaration import Candidate, Declaration
from moshpitd.matchmaking.liveness import PARTNER_PROBE, PER_KEY, Liveness, Vitals
from tests.unit.dht_fakes import FakeClock


class GatedProbe:
    """Answers each probe once the test says so; records who was asked."""

    def __init__(self, alive: set[bytes]) -> None:
        self.alive = alive
        self.asked: list[bytes] = []
        self.gate = asyncio.Event()

    async def __call__(self, endpoint: str, peer_id: bytes) -> bool:
        self.asked.append(peer_id)
        await self.gate.wait()
        return peer_id in self.alive


def pid(i: int) -> bytes:
    return bytes([i]) * 20


def candidate(i: int, version: int, client_mode: bool = False) -> Candidate:
    return Candidate(pid(i), Declaration(f"127.0.0.1:{1000 + i}", b"s", client_mode), 0.0,
                     version)


def test_probes_run_in_the_background_a_bounded_number_at_a_time() -> None:
    async def main() -> None:
        clock = FakeClock()
        probe = GatedProbe({pid(1), pid(2)})
        live = Liveness(probe, proven_seconds=60, failed_seconds=10, max_in_flight=2,
                        clock=clock)
        woken: list[int] = []
        stop = live.listen(lambda: woken.append(1))
        live.known = {pid(1), pid(2)}.__contains__  # DHT contacts go first
        live.check("k", ((pid(i), "x") for i in range(5, 0, -1)))
        await asyncio.sleep(0)
        assert sorted(probe.asked) == [pid(1), pid(2)] and live.deferred == 1
        live.check("k", [(pid(1), "x")])  # in flight: not asked twice
        probe.gate.set()
        while live._in_flight:
            await asyncio.sleep(0)
        assert live.proven(pid(1)) and live.proven(pid(2))
        assert len(woken) == 2  # each proof wakes the listeners
        live.check("k", ((pid(i), "x") for i in range(1, 6)))  # the proven are not asked
        while live._in_flight:
            await asyncio.sleep(0)
        assert len(probe.asked) == 4 and set(probe.asked[2:]) <= {pid(3), pid(4), pid(5)}
        assert len(woken) == 2  # failures wake nobody
        failed = [p for p in (pid(3), pid(4), pid(5)) if live.failed(p)]
        assert len(failed) == 2
        stop()
        clock.now += 11  # a failure is forgotten first, then an answer
        assert not live.failed(failed[0]) and live.proven(pid(1))
        clock.now += 50
        assert not live.proven(pid(1))
    asyncio.run(main())


def test_one_key_holds_at_most_its_share_of_the_probes() -> None:
    async def main() -> None:
        probe = GatedProbe(set())
        live = Liveness(probe, max_in_flight=16)
        live.check("flooded", ((pid(i), "x") for i in range(1, 40)))
        live.check("other", [(pid(50), "x")])
        await asyncio.sleep(0)
        assert len(probe.asked) == PER_KEY + 1 and pid(50) in probe.asked
        await live.close()
    asyncio.run(main())


def test_the_oldest_are_forgotten_first_beyond_capacity() -> None:
    live = Liveness(GatedProbe(set()), capacity=3)
    for i in range(5):
        live.vouch(pid(i))
    assert [live.proven(pid(i)) for i in range(5)] == [False, False, True, True, True]


def test_a_request_follows_and_waits_only_for_proven_peers() -> None:
    """Unproven candidates are probed and do not count meanwhile; followers and client-mode
    peers always count; a failed one is left out until its failure is old, then asked again."""
    async def main() -> None:
        clock = FakeClock()
        probe = GatedProbe({pid(5)})
        live = Liveness(probe, failed_seconds=10, clock=clock)
        live.vouch(pid(1))
        dead: set[bytes] = set()
        vitals = Vitals("k", dead, live, live.ask)
        cands = [candidate(1, 50), candidate(3, 30), candidate(4, 60), candidate(5, 10),
                 candidate(6, 70, client_mode=True), candidate(7, 5)]
        taken = vitals.proven(cands, followers={pid(4)})
        assert {c.peer_id for c in taken} == {pid(1), pid(4), pid(6)}
        await asyncio.sleep(0)
        assert sorted(probe.asked) == [pid(3), pid(5), pid(7)]
        probe.gate.set()
        while live._in_flight:
            await asyncio.sleep(0)
        taken = vitals.proven(cands, followers={pid(4)})
        assert {c.peer_id for c in taken} == {pid(1), pid(4), pid(5), pid(6)}
        await asyncio.sleep(0)
        assert len(probe.asked) == 3 and not dead  # the failed wait out their time
        clock.now += 11
        vitals.proven(cands, followers={pid(4)})
        await asyncio.sleep(0)
        assert sorted(probe.asked[3:]) == [pid(3), pid(7)]
        await live.close()
    asyncio.run(main())


def test_without_liveness_every_candidate_counts() -> None:
    cands = [candidate(1, 5), candidate(2, 6)]
    assert Vitals("k", set(), None, None).proven(cands, followers=()) == cands


def test_a_member_we_excluded_must_answer_again() -> None:
    live = Liveness(GatedProbe(set()))
    live.vouch(pid(1))
    live.unprove(pid(1))
    assert not live.proven(pid(1)) and not live.failed(pid(1))


def test_dht_contacts_are_asked_to_lead_first() -> None:
    live = Liveness(GatedProbe(set()))
    live.known = {pid(2), pid(3)}.__contains__
    vitals = Vitals("k", set(), live, live.ask)
    cands = [candidate(1, 5), candidate(3, 30), candidate(2, 40), candidate(4, 1)]
    assert [c.peer_id for c in vitals.asking_order(cands)] == [pid(3), pid(2), pid(4), pid(1)]


def test_partners_of_the_last_group_are_awaited_while_they_answer() -> None:
    """A leader's partners from its last group that have not declared: the live ones are
    awaited, a dead one is dead for the request; each is asked again only after PARTNER_PROBE,
    and nobody is asked while we have no follower, or for partners seen declared or with us."""
    async def main() -> None:
        probe = GatedProbe({pid(2)})
        probe.gate.set()
        dead: set[bytes] = set()
        vitals = Vitals("k", dead, None, probe)
        partners = {pid(i): f"127.0.0.1:{1000 + i}" for i in (1, 2, 3, 4)}
        declared = {pid(4)}  # seen declared in this request
        assert await vitals.partners_coming(partners, declared, followers=(), now=0.0) == set()
        assert probe.asked == []
        got = await vitals.partners_coming(partners, declared, followers={pid(1)}, now=0.0)
        assert got == {pid(2)} and dead == {pid(3)}
        assert sorted(probe.asked) == [pid(2), pid(3)]
        await vitals.partners_coming(partners, declared, {pid(1)}, now=PARTNER_PROBE / 2)
        assert len(probe.asked) == 2  # asked lately
        probe.alive.clear()  # killed since
        got = await vitals.partners_coming(partners, declared, {pid(1)}, now=PARTNER_PROBE)
        assert got == set() and dead == {pid(2), pid(3)}
    asyncio.run(main())
