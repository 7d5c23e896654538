"""Sessions (transport/session.py) on their own: the keys a kept connection gives each later
stream, and the pool of idle connections."""

from __future__ import annotations

import asyncio
import os

import pytest

from moshpitd.auth import SwarmKey
from moshpitd.identity import PeerKey
from moshpitd.transport.dataplane import HEADER, PART
from moshpitd.transport.framecrypt import TAG, FrameCipher, TamperedFrame
from moshpitd.transport.handshake import Handshake
from moshpitd.transport.session import Attach, Session, SessionPool, stream_context

KEYS = [PeerKey.generate() for _ in range(2)]
SWARM = SwarmKey(os.urandom(32))
DIGEST = b"d" * 32


def sessions(encrypt: bool = True) -> tuple[Session, Session]:
    """(the opener's, the acceptor's) after one real handshake from member 0 to member 1."""
    opener, acceptor = Handshake(KEYS[0], SWARM, encrypt), Handshake(KEYS[1], SWARM, encrypt)
    wire, pending = opener.hello(b"g" * 16, DIGEST, KEYS[1].peer_id, 0, 1)
    ready, _, theirs = acceptor.accept(acceptor.open_hello(wire, 0, 1), DIGEST, KEYS[0].peer_id,
                                       0, 1)
    _, mine = opener.finish(pending, ready)
    return mine, theirs


def frame(cipher: FrameCipher, payload: bytes = b"hello") -> tuple[bytes, bytearray]:
    header = HEADER.pack(PART, 0, 0, 3, len(payload) + TAG, 0)
    out = bytearray(len(payload) + TAG)
    cipher.seal_into(header, [payload], memoryview(out))
    return header, out


def test_each_end_knows_the_peer_it_proved_and_both_derive_one_stream_s_keys() -> None:
    mine, theirs = sessions()
    assert mine.peer_id == KEYS[1].peer_id and theirs.peer_id == KEYS[0].peer_id
    ctx = stream_context(DIGEST, 0, 1)
    a, b = mine.next_stream(ctx), theirs.next_stream(ctx)
    assert a is not None and b is not None
    header, sealed = frame(a)
    assert bytes(b.open_in_place(header, memoryview(sealed))) == b"hello"
    header, sealed = frame(b, b"back")  # and the other way
    assert bytes(a.open_in_place(header, memoryview(sealed))) == b"back"


def test_a_frame_of_one_stream_is_refused_in_any_other() -> None:
    mine, theirs = sessions()
    ctx = stream_context(DIGEST, 0, 1)
    first = mine.next_stream(ctx)
    assert first is not None and theirs.next_stream(ctx) is not None
    header, sealed = frame(first)
    # the next stream of the same session, for the very same group and members: new keys
    second = theirs.next_stream(ctx)
    assert second is not None and mine.next_stream(ctx) is not None
    with pytest.raises(TamperedFrame):
        second.open_in_place(header, memoryview(bytearray(sealed)))
    # another group on this session, or the same stream numbers on another session
    assert theirs.next_stream(stream_context(b"e" * 32, 0, 1)) is not None
    _, other_theirs = sessions()
    other = other_theirs.next_stream(ctx)
    assert other is not None
    with pytest.raises(TamperedFrame):
        other.open_in_place(header, memoryview(bytearray(sealed)))
    # nor as a control frame between streams
    assert theirs.control is not None
    with pytest.raises(TamperedFrame):
        theirs.control.open_in_place(header, memoryview(bytearray(sealed)))


def test_control_frames_are_sealed_between_the_two_ends_only() -> None:
    mine, theirs = sessions()
    assert mine.control is not None and theirs.control is not None
    attach = Attach(b"g" * 16, DIGEST, 0, 1).pack()
    header, sealed = frame(mine.control, attach)
    assert Attach.unpack(theirs.control.open_in_place(header, memoryview(sealed))) == \
        Attach(b"g" * 16, DIGEST, 0, 1)
    replay = bytearray(sealed)  # the same ATTACH again: its nonce is used up
    with pytest.raises(TamperedFrame):
        theirs.control.open_in_place(header, memoryview(replay))


def test_without_encryption_a_session_seals_nothing() -> None:
    mine, theirs = sessions(encrypt=False)
    assert mine.secret is None and mine.control is None and theirs.control is None
    assert mine.next_stream(stream_context(DIGEST, 0, 1)) is None
    assert mine.peer_id == KEYS[1].peer_id


class FakeChannel:
    """What the pool touches of a dataplane.Channel."""

    def __init__(self, peer: bytes = b"p" * 20) -> None:
        self.session: Session | None = Session(peer, os.urandom(32), opener=True)
        self.cipher: FrameCipher | None = None
        self.sink: object = None
        self.open, self.closed = True, 0

    def is_open(self) -> bool:
        return self.open

    def close(self) -> None:
        self.open = False
        self.closed += 1


def test_the_pool_hands_out_live_sessions_to_that_peer_only_and_bounds_what_it_keeps() -> None:
    async def main() -> None:
        pool = SessionPool(idle_seconds=0.05, max_per_peer=2, max_idle=3)
        a, b, c = FakeChannel(), FakeChannel(), FakeChannel()
        for ch in (a, b, c):
            pool.keep("h:1", ch)  # type: ignore[arg-type]
        assert a.closed == 1 and len(pool) == 2  # two per peer: the oldest went
        assert b.session is not None and b.cipher is b.session.control  # sealed while idle
        assert pool.take("h:2", b"p" * 20) is None  # another endpoint
        assert pool.take("h:1", b"q" * 20) is None  # another peer
        c.open = False  # its peer hung up: never handed out
        assert pool.take("h:1", b"p" * 20) is b  # (c, the newest, was dead and dropped)
        assert pool.take("h:1", b"p" * 20) is None and len(pool) == 0
        others = [FakeChannel(bytes([i]) * 20) for i in range(5)]
        for ch in others:
            pool.keep("h:1", ch)  # type: ignore[arg-type]
        assert len(pool) == 3 and [ch.closed for ch in others] == [1, 1, 0, 0, 0]
        async with asyncio.timeout(5):  # unused past idle_seconds: each closes
            while any(ch.closed == 0 for ch in others):
                await asyncio.sleep(0.005)
        assert len(pool) == 0 and all(ch.closed == 1 for ch in others)
        no_session = FakeChannel()
        no_session.session = None
        pool.keep("h:1", no_session)  # type: ignore[arg-type]
        assert no_session.closed == 1 and len(pool) == 0

    asyncio.run(main())


def test_the_sessions_a_daemon_accepted_are_bounded_per_peer_over_real_connections() -> None:
    """A member that opens a new connection every round, instead of reusing its own, leaves
    one idle session per round with the owner: at most MAX_PER_PEER are kept per peer (the
    oldest closed), and another peer's session is untouched."""
    from moshpitd.allreduce.registry import RoundRegistry
    from moshpitd.transport.session import MAX_PER_PEER

    async def main() -> None:
        registry = RoundRegistry(1 << 20)
        port = await registry.start("127.0.0.1", 0)
        clients = []
        for _ in range(MAX_PER_PEER + 3):
            clients.append(await asyncio.open_connection("127.0.0.1", port))
        async with asyncio.timeout(5):
            while len(registry.unopened) < len(clients):
                await asyncio.sleep(0.001)
        accepted = [h.channel for h in list(registry.unopened)]
        assert all(ch is not None for ch in accepted)
        honest = accepted.pop()
        assert honest is not None
        honest.session = Session(b"h" * 20, None, opener=False)
        registry.release(honest)
        for ch in accepted:  # one peer, a new connection each "round"
            assert ch is not None
            ch.session = Session(b"m" * 20, None, opener=False)
            registry.release(ch)
        kept = [r.channel for r in registry.idle]
        assert len(kept) == MAX_PER_PEER + 1 and honest in kept
        assert all(not ch.is_open() for ch in accepted[:-MAX_PER_PEER] if ch is not None)
        assert all(ch.is_open() for ch in accepted[-MAX_PER_PEER:] if ch is not None)
        for _, writer in clients:
            writer.close()
        await registry.stop()
        assert not registry.idle

    asyncio.run(main())
