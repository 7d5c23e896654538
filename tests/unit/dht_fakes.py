"""Fakes and signed-record helpers shared by the DHT protocol's unit tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import umsgpack
from kademlia.node import Node

from moshpitd.dht.protocol import SubkeyProtocol
from moshpitd.dht.records import sign
from moshpitd.dht.storage import SubkeyStorage
from moshpitd.identity import PeerKey

SELF_ID = b"\x01" * 20
PEER_ID = b"\x02" * 20
KEY = b"\x03" * 20
ADDR = ("10.0.0.2", 4000)
WRITER_A, WRITER_B = PeerKey.generate(), PeerKey.generate()
A, B = WRITER_A.peer_id, WRITER_B.peer_id
def signed(writer: PeerKey, value: bytes, version: int, ttl: float, key: bytes = KEY
           ) -> tuple[bytes, bytes, bytes, int, float, list[object]]:
    """store_sub's arguments after the sender's node id, for a record `writer` signed."""
    proof = sign(writer, key, value, version, ttl)
    return key, writer.peer_id, value, version, ttl, proof.wire()


class FakeClock:
    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now


class FakeTransport:
    def __init__(self) -> None:
        self.sent: list[tuple[bytes, tuple[str, int]]] = []

    def sendto(self, data: bytes, addr: tuple[str, int]) -> None:
        self.sent.append((data, addr))


def proto(self_id: bytes = SELF_ID, transport: bool = False) -> SubkeyProtocol:
    storage = SubkeyStorage(clock=FakeClock())
    proto = SubkeyProtocol(Node(self_id, "127.0.0.1", 1), storage, ksize=20, wait_timeout=1.0)
    if transport:
        proto.connection_made(FakeTransport())  # type: ignore[arg-type]
    return proto


def in_loop(body: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(body(), 5.0))


def request(name: str, *args: object, msg_id: bytes = b"\x07" * 20) -> bytes:
    return b"\x00" + msg_id + umsgpack.packb([name, list(args)])


def pings(proto: SubkeyProtocol) -> list[tuple[bytes, tuple[str, int]]]:
    """The pings `proto` sent through its FakeTransport: (message id, address)."""
    sent = proto.transport.sent  # type: ignore[union-attr]
    return [(d[1:21], a) for d, a in sent
            if d[:1] == b"\x00" and umsgpack.unpackb(d[21:])[0] == "ping"]
