from moshpitd.matchmaking.shunned import Shunned


def test_shunned_leaders_are_forgotten_after_their_time_and_oldest_first_when_full() -> None:
    now = [0.0]
    shunned = Shunned(seconds=10.0, capacity=3, clock=lambda: now[0])
    assert shunned.add(b"a") == b"a"
    now[0] = 4.0
    shunned.add(b"b")
    assert shunned.current() == {b"a", b"b"}
    now[0] = 10.0  # a's time is over, b's is not
    assert shunned.current() == {b"b"}
    for peer in (b"c", b"d", b"e"):  # a fourth pushes out the one shunned longest ago
        shunned.add(peer)
    assert shunned.current() == {b"c", b"d", b"e"} and len(shunned) == 3
    shunned.add(b"c")  # shunned again: its time starts over, and it is the newest
    shunned.add(b"f")
    assert shunned.current() == {b"c", b"e", b"f"}
    copy = shunned.current()
    copy.add(b"g")  # a request's own dead peers stay its own
    assert b"g" not in shunned.current()
