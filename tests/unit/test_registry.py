"""The data plane's round registry: which incoming streams it admits, and to which round.

Streams are routed by their (real, signed) handshakes; the rounds and channels are stand-ins.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from moshpitd.allreduce import registry as reg
from moshpitd.allreduce.group import Group, GroupMember
from moshpitd.allreduce.registry import RoundRegistry
from moshpitd.identity import PeerKey
from moshpitd.transport.dataplane import BUSY, READY, DataPlaneError
from moshpitd.transport.handshake import Handshake

KEYS = [PeerKey.generate() for _ in range(3)]


class FakeTransport:
    def __init__(self, host: str) -> None:
        self.host = host

    def get_extra_info(self, name: str) -> Any:
        return (self.host, 4242) if name == "peername" else None

    def is_closing(self) -> bool:
        return False

    def resume_reading(self) -> None:
        pass


class FakeChannel:
    def __init__(self, host: str = "10.0.0.1") -> None:
        self.aborted: str | None = None
        self.code = 0
        self.transport = FakeTransport(host)
        self.sink: Any = None
        self.cipher: Any = None
        self.sent: list[tuple[int, int]] = []

    def send_nowait(self, kind: int, part: int, payload: bytes = b"", aux: int = 0) -> None:
        self.sent.append((kind, part))

    def abort(self, why: object, part: int = 0, code: int = 0) -> None:
        self.aborted, self.code = str(why), code


def group(gid: bytes) -> Group:
    return Group(gid, "k", 0, b"s" * 16, tuple(GroupMember(k.peer_id, "", 1.0) for k in KEYS))


class FakeRound:
    """Member 1 of a group of three; it takes each sender once."""

    def __init__(self, g: Group) -> None:
        self.group, self.me, self.accepted = g, 1, list[int]()
        self.reducer = SimpleNamespace(check_sender=self.check_sender)

    def check_sender(self, sender: int) -> None:
        if sender in self.accepted:
            raise DataPlaneError(f"sender {sender} already streamed")

    def accept(self, sender: int, channel: object) -> str:
        self.accepted.append(sender)
        return "sink"


def stream(registry: RoundRegistry, g: Group, sender: int = 0, key: PeerKey | None = None,
           wire: bytes | None = None, host: str | None = None) -> FakeChannel:
    """A stream from member `sender` (its HELLO signed by `key`, its own by default), from
    `host` (by default one of its own per sender)."""
    if wire is None:
        wire, _ = Handshake(key or KEYS[sender]).hello(*g.route_to(1), sender, 1)
    channel = FakeChannel(host or f"10.0.0.{sender + 1}")
    hello = registry.handshake.open_hello(wire, sender, 1)
    registry.route(channel, hello, sender, 1)  # type: ignore[arg-type]
    return channel


def test_a_stream_for_an_ended_round_is_refused_at_once() -> None:
    async def scenario() -> tuple[str | None, float]:
        registry = RoundRegistry(1 << 20, Handshake(KEYS[1]))
        g = group(b"g" * 16)
        rnd = FakeRound(g)
        registry.register(rnd)  # type: ignore[arg-type]
        live = stream(registry, g)
        assert rnd.accepted == [0] and live.aborted is None and live.sink == "sink"
        assert live.sent == [(READY, 1)]  # the sender may stream now
        registry.unregister(g.group_id)
        started = time.monotonic()
        late = stream(registry, g, 2)
        assert late.sent == []
        return late.aborted, time.monotonic() - started

    aborted, waited = asyncio.run(scenario())
    assert aborted is not None and "is over here" in aborted
    assert waited < 0.5 < RoundRegistry(1 << 20).stream_wait  # not the stream wait


def test_finished_rounds_are_remembered_up_to_a_bound(monkeypatch: Any) -> None:
    monkeypatch.setattr(reg, "MAX_FINISHED", 3)
    registry = RoundRegistry(1 << 20)
    for i in range(5):
        registry.unregister(bytes([i]) * 16)
    assert list(registry._finished) == [bytes([i]) * 16 for i in (2, 3, 4)]


def test_strangers_share_a_bounded_table_and_never_hold_back_a_group_we_hold() -> None:
    """Two streams of unknown groups fill the table; a third is refused as busy. A stream of a
    group we hold is admitted all the same, and one of a group that becomes ours while it
    waits goes to its round."""
    async def scenario() -> None:
        registry = RoundRegistry(1 << 20, Handshake(KEYS[1]), stream_wait=0.05,
                                 max_strangers=2)
        early, ours = group(b"e" * 16), group(b"o" * 16)
        waiting = [stream(registry, early), stream(registry, group(b"x" * 16), host="10.9.9.9")]
        assert registry.strangers == 2 and all(w.aborted is None for w in waiting)
        busy = stream(registry, group(b"y" * 16), host="10.8.8.8")
        assert busy.code == BUSY and busy.aborted is not None and "again" in busy.aborted
        held = FakeRound(ours)
        registry.register(held)  # type: ignore[arg-type]
        admitted = stream(registry, ours)
        assert admitted.aborted is None and held.accepted == [0]
        late = FakeRound(early)
        registry.register(late)  # type: ignore[arg-type]
        assert waiting[0].sink == "sink" and late.accepted == [0] and registry.strangers == 1
        # the other one's group never comes: its stream is aborted once stream_wait is over
        async with asyncio.timeout(5):
            while waiting[1].aborted is None:
                await asyncio.sleep(0.005)
        assert waiting[1].aborted is not None and "no group" in waiting[1].aborted
        assert registry.refused == {"busy": 1, "group": 1} and registry.strangers == 0

    asyncio.run(scenario())


def test_one_host_holds_at_most_half_of_the_strangers_table() -> None:
    """A flood of HELLOs for made-up groups from one host fills its half only: another host's
    stream still waits for its group, and the flooder's streams leave room as they go."""
    async def scenario() -> None:
        registry = RoundRegistry(1 << 20, Handshake(KEYS[1]), stream_wait=10.0,
                                 max_strangers=8)
        flood = [stream(registry, group(bytes([i]) * 16), host="10.6.6.6") for i in range(6)]
        assert [f.code for f in flood] == [0] * 4 + [BUSY] * 2
        honest = stream(registry, group(b"h" * 16), host="10.0.0.1")
        assert honest.aborted is None and registry.strangers == 5
        held = FakeRound(group(b"h" * 16))
        registry.register(held)  # type: ignore[arg-type]
        assert held.accepted == [0] and registry.strangers == 4
        late = FakeRound(group(bytes([0]) * 16))
        registry.register(late)  # type: ignore[arg-type]  # one of the flood's groups, after all
        assert registry.strangers == 3
        again = stream(registry, group(b"z" * 16), host="10.6.6.6")
        assert again.aborted is None and registry.strangers == 4  # its half has room again

    asyncio.run(scenario())


def test_a_stream_must_prove_the_member_it_names() -> None:
    """Another key's HELLO as member 0 is refused and leaves member 0's slot free; member 0's
    own is then admitted; a copy of it is refused. Streams that waited for the group are
    examined in the order they came: an impostor that came first is refused for its key, not
    for a slot the real member took meanwhile."""
    async def scenario() -> None:
        registry = RoundRegistry(1 << 20, Handshake(KEYS[1]))
        g = group(b"g" * 16)
        rnd = FakeRound(g)
        early = [stream(registry, g, 0, KEYS[2]), stream(registry, g, 0)]
        registry.register(rnd)  # type: ignore[arg-type]
        assert early[0].aborted is not None and early[1].sink == "sink"
        assert registry.refused == {"identity": 1} and rnd.accepted == [0]
        registry.refused.clear()
        rnd.accepted.clear()
        for key in (KEYS[2], PeerKey.generate()):
            forged = stream(registry, g, 0, key)
            assert forged.aborted is not None and "member 0" in forged.aborted
        assert rnd.accepted == [] and registry.refused == {"identity": 2}
        wire, _ = Handshake(KEYS[0]).hello(*g.route_to(1), 0, 1)
        genuine = stream(registry, g, wire=wire)
        assert genuine.aborted is None and rnd.accepted == [0]
        rnd.accepted.clear()  # even with the slot free again, the same HELLO opens nothing
        replayed = stream(registry, g, wire=wire)
        assert replayed.aborted is not None and "replayed" in replayed.aborted

    asyncio.run(scenario())
