"""Liveness and Vitals on a fake probe and clock: which declared peers count, and what a flood
of them costs."""

from __future__ import annotations

import asyncio

from moshpitd.matchmaking.declaration import Candidate, Declaration
from moshpitd.matchmaking.liveness import Liveness, Vitals


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


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
        probe = GatedProbe({pid(1)})
        live = Liveness(probe, proven_seconds=60, failed_seconds=10, max_in_flight=2,
                        clock=clock)
        woken: list[int] = []
        stop = live.listen(lambda: woken.append(1))
        live.check((pid(i), "x") for i in range(1, 6))
        await asyncio.sleep(0)
        assert probe.asked == [pid(1), pid(2)] and live.deferred == 1
        live.check([(pid(1), "x")])  # in flight: not asked twice
        probe.gate.set()
        while live._in_flight:
            await asyncio.sleep(0)
        assert live.proven(pid(1)) and not live.proven(pid(2)) and live.failed(pid(2))
        assert len(woken) == 2
        stop()
        live.check((pid(i), "x") for i in range(1, 6))  # the proven and failed are not asked
        while live._in_flight:
            await asyncio.sleep(0)
        assert probe.asked == [pid(1), pid(2), pid(3), pid(4)] and len(woken) == 2
        clock.now += 11  # a failure is forgotten first, then an answer
        assert not live.failed(pid(2)) and live.proven(pid(1))
        clock.now += 50
        assert not live.proven(pid(1))
    asyncio.run(main())


def test_the_oldest_are_forgotten_first_beyond_capacity() -> None:
    live = Liveness(GatedProbe(set()), capacity=3)
    for i in range(5):
        live.vouch(pid(i))
    assert [live.proven(pid(i)) for i in range(5)] == [False, False, True, True, True]


def test_a_request_follows_and_waits_only_for_proven_peers() -> None:
    """Unproven candidates are probed earliest-ranked first and do not count meanwhile; those
    found dead join the request's dead set; followers and client-mode peers always count."""
    async def main() -> None:
        probe = GatedProbe({pid(5)})
        live = Liveness(probe, max_in_flight=3)
        live.vouch(pid(1))
        dead: set[bytes] = set()
        vitals = Vitals("k", dead, live, live.ask)
        cands = [candidate(1, 50), candidate(2, 40), candidate(3, 30), candidate(4, 60),
                 candidate(5, 10), candidate(6, 70, client_mode=True), candidate(7, 5)]
        taken = vitals.proven(cands, followers={pid(4)})
        assert {c.peer_id for c in taken} == {pid(1), pid(4), pid(6)}
        await asyncio.sleep(0)
        assert probe.asked == [pid(7), pid(5), pid(3)]  # by rank, up to the bound
        probe.gate.set()
        while live._in_flight:
            await asyncio.sleep(0)
        taken = vitals.proven(cands, followers={pid(4)})
        assert {c.peer_id for c in taken} == {pid(1), pid(4), pid(5), pid(6)}
        assert dead == {pid(7), pid(3)}
        await asyncio.sleep(0)
        assert probe.asked[3:] == [pid(2)]  # the next unproven one, now that room was made
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
