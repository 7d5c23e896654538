"""The data plane's stream handshake (transport/handshake.py) and frame sealing
(transport/framecrypt.py), on their own: who may open a stream as whom, and what an altered
frame does."""

from __future__ import annotations

import os

import pytest

from moshpitd.allreduce.group import Group, GroupMember
from moshpitd.auth import SwarmKey
from moshpitd.identity import PeerKey
from moshpitd.transport.dataplane import HEADER, PART
from moshpitd.transport.framecrypt import TAG, FrameCipher, SendBuffers, TamperedFrame
from moshpitd.transport.handshake import Handshake, HandshakeError, UnsealedHello

KEYS = [PeerKey.generate() for _ in range(3)]
SWARM = SwarmKey(os.urandom(32))


def group(gid: bytes = b"g" * 16, weight: float = 1.0) -> Group:
    return Group(gid, "k", 0, b"s" * 16, tuple(GroupMember(k.peer_id, f"h:{i}", weight)
                                               for i, k in enumerate(KEYS)))


def sides(encrypt: bool = True, swarm: SwarmKey | None = SWARM) -> tuple[Handshake, Handshake]:
    """Member 0 (the sender) and member 1 (the owner)."""
    return Handshake(KEYS[0], swarm, encrypt), Handshake(KEYS[1], swarm, encrypt)


def accept(owner: Handshake, wire: bytes, g: Group, sender: int = 0, receiver: int = 1
           ) -> tuple[bytes, FrameCipher | None]:
    """The owner's READY and cipher for a HELLO from member `sender` of `g`."""
    hello = owner.open_hello(wire, sender, receiver)
    ready, cipher, _ = owner.accept(hello, g.digest, g.members[sender].peer_id, sender,
                                    receiver)
    return ready, cipher


def handshake(encrypt: bool = True) -> tuple[FrameCipher | None, FrameCipher | None]:
    """A whole handshake from member 0 to member 1: (the sender's cipher, the owner's)."""
    sender, owner = sides(encrypt)
    wire, pending = sender.hello(*group().route_to(1), 0, 1)
    assert len(wire) == owner.hello_length
    ready, owner_cipher = accept(owner, wire, group())
    return sender.finish(pending, ready)[0], owner_cipher


def test_both_sides_derive_the_same_keys_one_per_direction() -> None:
    mine, theirs = handshake()
    assert mine is not None and theirs is not None
    header = HEADER.pack(PART, 0, 0, 7, 5 + TAG, 0)
    for a, b in ((mine, theirs), (theirs, mine), (mine, theirs)):
        frame = bytearray(a.seal(header, b"hello"))
        assert bytes(b.open_in_place(header, memoryview(frame))) == b"hello"
    assert handshake(encrypt=False) == (None, None)  # authenticated, not sealed


def test_sealing_gathers_pieces_and_detects_any_change() -> None:
    """A frame of several pieces arrives whole; a flipped payload bit, an altered header, or a
    frame out of order fails authentication."""
    mine, theirs = handshake()
    assert mine is not None and theirs is not None
    pieces = [os.urandom(1000), memoryview(os.urandom(3000))]
    header = HEADER.pack(PART, 0, 0, 1, 4000 + TAG, 0)
    out = memoryview(bytearray(4000 + TAG))
    mine.seal_into(header, pieces, out)
    assert bytes(theirs.open_in_place(header, out)) == b"".join(map(bytes, pieces))
    first, second = bytearray(mine.seal(header, b"a" * 64)), bytearray(mine.seal(header, b"b"))
    flipped = bytearray(first)
    flipped[10] ^= 1
    for frame, head in ((flipped, header), (first, HEADER.pack(PART, 0, 0, 2, 64 + TAG, 0)),
                        (second, header)):
        with pytest.raises(TamperedFrame):
            theirs.open_in_place(head, memoryview(frame))


def test_a_stream_opens_only_as_the_member_whose_key_signs_it() -> None:
    """Member 2 (or an outsider's key) naming itself sender 0, a HELLO for another view of the
    group, and one sealed with another swarm key are refused; the owner's READY must be
    member 1's and answer this HELLO."""
    _, owner = sides()
    for key in (KEYS[2], PeerKey.generate()):
        wire, _ = Handshake(key, SWARM, True).hello(*group().route_to(1), 0, 1)
        with pytest.raises(HandshakeError, match="member 0"):
            accept(owner, wire, group())
    another_view = group(weight=5.0)
    wire, _ = Handshake(KEYS[0], SWARM, True).hello(*another_view.route_to(1), 0, 1)
    with pytest.raises(HandshakeError, match="does not verify"):
        accept(owner, wire, group())
    wire, _ = Handshake(KEYS[0], SwarmKey(os.urandom(32)), True).hello(*group().route_to(1), 0, 1)
    with pytest.raises(UnsealedHello):
        owner.open_hello(wire, 0, 1)
    wire, _ = Handshake(KEYS[0], SWARM, True).hello(*group().route_to(1), 0, 1)
    with pytest.raises(UnsealedHello):  # bound to its sender and receiver indices
        owner.open_hello(wire, 2, 1)
    # the sender: a READY from member 2 for our HELLO, or member 1's for another HELLO
    sender = Handshake(KEYS[0], SWARM, True)
    wire, pending = sender.hello(*group().route_to(1), 0, 1)
    impostor = Handshake(KEYS[2], SWARM, True)
    ready, _ = accept(impostor, wire, group())
    with pytest.raises(HandshakeError, match="peer id"):
        sender.finish(pending, ready)
    other, _ = sender.hello(*group().route_to(1), 0, 1)
    ready, _ = accept(owner, other, group())
    with pytest.raises(HandshakeError, match="does not verify"):
        sender.finish(pending, ready)


def test_daemons_that_disagree_on_encryption_say_so() -> None:
    plain, _ = sides(encrypt=False)
    _, sealed = sides(encrypt=True)
    wire, _ = plain.hello(*group().route_to(1), 0, 1)
    with pytest.raises(HandshakeError, match="data_encryption"):
        sealed.open_hello(wire, 0, 1)


def test_send_buffers_are_reused_only_once_their_bytes_left() -> None:
    buffers = SendBuffers()
    a = buffers.take(100, released=0)
    buffers.hold(a, end=100)
    b = buffers.take(100, released=50)  # a's bytes are still in the transport
    assert b is not a
    buffers.hold(b, end=200)
    assert buffers.take(100, released=100) is a
