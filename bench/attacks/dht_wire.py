"""A DHT peer spoken by hand: raw datagrams in the protocol's own encoding (rpcudp framing,
umsgpack bodies, sealed with the swarm key when one is given), as an attacker who holds the
swarm key would send them. Records are signed with whichever peer key the caller passes.

Used by the regression tests of the DHT's bounds and by the soak's attacker (bench/attacks)."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import umsgpack
from kademlia.utils import digest

from moshpitd.auth import SwarmKey
from moshpitd.dht.records import sign
from moshpitd.identity import PeerKey


def hostport(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


class RawDHT:
    def __init__(self, swarm_key: SwarmKey | None = None, node_id: bytes | None = None,
                 host: str = "127.0.0.1") -> None:
        self.key = swarm_key
        self.node_id = node_id or os.urandom(20)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, 0))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawDHT:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, addr: tuple[str, int], name: str, *args: Any) -> bytes:
        """Send one request; returns its message id."""
        msg_id = os.urandom(20)
        data = b"\x00" + msg_id + umsgpack.packb([name, list(args)])
        self.sock.sendto(data if self.key is None else self.key.seal(b"dht", b"dht", data), addr)
        return msg_id

    def replies(self, ids: set[bytes], timeout: float = 5.0) -> dict[bytes, Any]:
        """The answers to the requests `ids`, as they come (the daemon's own requests to us,
        now that we are its contact, are skipped); those unanswered in time are missing."""
        got: dict[bytes, Any] = {}
        deadline = time.monotonic() + timeout
        while len(got) < len(ids) and (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(1 << 16)
            except TimeoutError:
                break
            if self.key is not None:
                data = self.key.open(b"dht", b"dht", data)
            if data[:1] == b"\x01" and data[1:21] in ids:
                got[data[1:21]] = umsgpack.unpackb(data[21:])
        return got

    def call(self, addr: tuple[str, int], name: str, *args: Any, timeout: float = 5.0) -> Any:
        msg_id = self.send(addr, name, *args)
        return self.replies({msg_id}, timeout).get(msg_id)

    def store_sub(self, addr: tuple[str, int], key: str, writer: PeerKey, value: bytes,
                  version: int | None = None, ttl: float = 60.0, subkey: bytes | None = None,
                  proof: Any = None, send_only: bool = False, timeout: float = 5.0) -> Any:
        """A record under `subkey` (default: the writer's own id), signed by `writer` unless
        `proof` is given; its answer (None if none came within `timeout`)."""
        dkey = digest(key)
        version = time.time_ns() if version is None else version
        wire = sign(writer, dkey, value, version, ttl).wire() if proof is None else proof
        args = (self.node_id, dkey, subkey or writer.peer_id, value, version, ttl, wire)
        if send_only:
            return self.send(addr, "store_sub", *args)
        return self.call(addr, "store_sub", *args, timeout=timeout)

    def find_subs(self, addr: tuple[str, int], key: str) -> list[list[Any]]:
        answer = self.call(addr, "find_subs", self.node_id, digest(key))
        assert isinstance(answer, dict), answer
        return list(answer["subs"])

    def leave(self, addr: tuple[str, int]) -> None:
        """Say goodbye, so the daemon stops routing its lookups to this silent contact."""
        self.call(addr, "leave", self.node_id, timeout=1.0)
