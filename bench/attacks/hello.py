"""Data-plane streams opened by a key holder for groups nobody holds: each a valid sealed and
signed HELLO, then silence. A daemon must bound what it keeps for them."""

from __future__ import annotations

import os
import socket

from moshpitd.allreduce.group import Group, GroupMember
from moshpitd.auth import SwarmKey
from moshpitd.identity import PeerKey
from moshpitd.transport.dataplane import HEADER, HELLO
from moshpitd.transport.handshake import Handshake


def hello_stream(endpoint: str, swarm: SwarmKey, keys: tuple[PeerKey, PeerKey],
                 timeout: float = 5.0, source: str = "") -> socket.socket:
    """One stream to a data plane, opened by a valid HELLO from `keys[0]` for a made-up group
    of the two, kept open; from the address `source` if given."""
    host, port = endpoint.rsplit(":", 1)
    group = Group(os.urandom(16), "flood", 0, b"s" * 16,
                  tuple(GroupMember(k.peer_id, "", 1.0) for k in keys))
    wire, _ = Handshake(keys[0], swarm, encrypt=True).hello(*group.route_to(1), 0, 1)
    s = socket.create_connection((host, int(port)), timeout=timeout,
                                 source_address=(source, 0) if source else None)
    s.sendall(HEADER.pack(HELLO, 0, 0, 1, len(wire), 0) + wire)
    return s


def hello_flood(endpoint: str, swarm: SwarmKey, count: int) -> list[socket.socket]:
    """`count` streams to a data plane, each opened by a valid sealed and signed HELLO (a key
    holder with made-up identities) for a group nobody holds, kept open."""
    keys = (PeerKey.generate(), PeerKey.generate())
    return [hello_stream(endpoint, swarm, keys) for _ in range(count)]
