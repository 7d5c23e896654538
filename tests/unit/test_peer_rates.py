"""The rates a leader lets followers declare (allreduce/rates.py PeerRates): at most what their
streams carried to it, scaled for the streams a link carries at once."""

from __future__ import annotations

from moshpitd.allreduce.rates import CAP_FACTOR, CAP_WINDOW, PeerRates, stream_rate
from moshpitd.transport.stats import Stats

A, B = b"a" * 20, b"b" * 20


def test_an_unmeasured_peer_keeps_its_declared_rate() -> None:
    rates = PeerRates()
    assert rates.cap_mbit(A, 4) is None
    assert rates.capped_rate(A, 1e12, 4) == 1e12 and rates.capped == 0


def test_a_declared_rate_above_what_its_streams_carried_is_lowered_to_the_cap() -> None:
    rates = PeerRates()
    rates.observe(A, 4e6)  # 4 MB/s on one stream to us: 32 Mbit/s
    rates.observe(A, 1e6)  # a slower round does not lower the cap: the best counts
    cap = CAP_FACTOR * 3 * 32.0  # in a group of 4, its link carried 3 streams at once
    assert rates.cap_mbit(A, 4) == cap
    assert rates.capped_rate(A, 100.0, 4) == 100.0 and rates.capped == 0  # honest: under it
    assert rates.capped_rate(A, 1e12, 4) == cap and rates.capped == 1
    assert rates.cap_mbit(B, 4) is None  # per peer


def test_only_recent_measurements_count_and_the_map_is_bounded() -> None:
    rates = PeerRates(max_peers=2)
    rates.observe(A, 8e6)
    for _ in range(CAP_WINDOW):
        rates.observe(A, 1e6)  # the fast round has left the window
    assert rates.cap_mbit(A, 2) == CAP_FACTOR * 8.0
    rates.observe(B, 1e6)
    rates.observe(b"c" * 20, 1e6)  # a third peer: the least recently measured goes
    assert rates.cap_mbit(A, 2) is None and rates.cap_mbit(B, 2) is not None
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        rates.observe(B, bad)  # ignored
    assert rates.cap_mbit(B, 2) == CAP_FACTOR * 8.0


def test_a_stream_that_moved_little_teaches_no_rate() -> None:
    assert stream_rate(Stats(1000, 0, 1.0, 2.0, 0.0, 0.0)) == 0.0
    assert stream_rate(Stats(1 << 20, 0, 1.0, 1.5, 0.0, 0.0)) == 2 * (1 << 20)


def test_a_round_keeps_only_the_rates_of_streams_their_senders_held_back() -> None:
    """Streams as fast as the round's fastest were held back by our own link: they bound
    nothing of their senders' (a slow leader would cap every fast follower at its download)."""
    from types import SimpleNamespace

    from moshpitd.allreduce.butterfly import ButterflyRound

    def stats(mb_per_s: float) -> Stats:
        return Stats(int(mb_per_s * 1e6), 0, 10.0, 11.0, 0.0, 0.0)

    members = [SimpleNamespace(peer_id=bytes([i]) * 20) for i in range(4)]
    links = [SimpleNamespace(owner=1, stats=lambda: stats(10.0)),
             SimpleNamespace(owner=2, stats=lambda: stats(9.0)),
             SimpleNamespace(owner=3, stats=lambda: None)]  # never opened
    slots = {3: SimpleNamespace(sender=3, stats=lambda: stats(2.0)),
             1: SimpleNamespace(sender=1, stats=lambda: stats(4.0))}
    rnd = SimpleNamespace(plan=SimpleNamespace(group=SimpleNamespace(members=members)),
                          reducer=SimpleNamespace(slots=slots), peer_rates={})
    ButterflyRound._time_peers(rnd, SimpleNamespace(links=links))  # type: ignore[arg-type]
    assert rnd.peer_rates == {members[3].peer_id: 2e6}
