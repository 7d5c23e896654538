"""The reachability check's two sides on loopback: a dialer (DialBack) that dials the checked
peer's three ports, and the checked peer's verdict (Reachability) from what got through."""

from __future__ import annotations

import asyncio
import os
import socket

import msgpack
import pytest

from moshpitd.auth import SwarmKey
from moshpitd.nat import reach
from moshpitd.nat.reach import DialBack, Reachability
from moshpitd.nat.wire import read_frame
from moshpitd.transport.gate import REACH_MAGIC


class _Ports:
    """The checked peer's three ports, each telling `seen` of the nonces it receives: what the
    DHT, the gate and the registry do with a dial-back."""

    def __init__(self, checked: Reachability, swarm: SwarmKey | None, open_kinds: set[str]
                 ) -> None:
        self.checked, self.swarm, self.open = checked, swarm, open_kinds
        self.closers: list[object] = []

    async def start(self) -> tuple[int, int, int]:
        loop = asyncio.get_running_loop()
        ports = []
        for kind in ("dht", "grpc", "data"):
            if kind == "dht":
                transport, _ = await loop.create_datagram_endpoint(
                    lambda: _Datagrams(self), local_addr=("127.0.0.1", 0))
                port = transport.get_extra_info("sockname")[1]
                self.closers.append(transport)
            else:
                server = await asyncio.start_server(
                    lambda r, w, kind=kind: self._stream(kind, r, w), "127.0.0.1", 0)
                port = server.sockets[0].getsockname()[1]
                self.closers.append(server)
            if kind not in self.open:  # a closed port: nothing listens there
                self.closers.pop().close()  # type: ignore[attr-defined]
            ports.append(port)
        return ports[0], ports[1], ports[2]

    async def _stream(self, kind: str, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        if kind == "grpc":
            first = await reader.read(64)
            assert first.startswith(REACH_MAGIC)
            self.checked.reached(first[len(REACH_MAGIC):], "grpc")
        else:
            _op, payload = await read_frame(reader)
            nonce = reach.nonce_of(payload, self.swarm)
            if nonce is not None:
                self.checked.reached(nonce, "data")
        writer.close()

    def close(self) -> None:
        for c in self.closers:
            c.close()  # type: ignore[attr-defined]


class _Datagrams(asyncio.DatagramProtocol):
    def __init__(self, ports: _Ports) -> None:
        self.ports = ports

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if self.ports.swarm is not None:
            data = self.ports.swarm.open(b"dht", b"dht", data)
        name, args = msgpack.unpackb(data[21:])
        assert data[:1] == b"\x00" and name == "reached"
        self.ports.checked.reached(args[0], "dht")


async def _verdict(open_kinds: set[str], swarm: SwarmKey | None, own: tuple[str, ...] = ()
                   ) -> reach.Verdict:
    checked = Reachability()
    ports = _Ports(checked, swarm, open_kinds)
    own_ports = await ports.start()
    dialers = [DialBack(swarm) for _ in range(3)]

    async def ask(dialer: object, nonce: bytes) -> tuple[str, bool]:
        assert isinstance(dialer, DialBack)
        return "127.0.0.1", dialer.request(("127.0.0.1", 4242), nonce, ports_open)
    ports_open = own_ports
    try:
        return await checked.check(dialers, ask, own)
    finally:
        ports.close()
        for d in dialers:
            await d.close()


@pytest.mark.parametrize("swarm", [None, SwarmKey(os.urandom(32))])
def test_a_peer_whose_ports_take_dial_backs_is_public(swarm: SwarmKey | None) -> None:
    verdict = asyncio.run(_verdict({"dht", "grpc", "data"}, swarm))
    assert verdict.state == reach.PUBLIC, verdict
    assert verdict.observed == "127.0.0.1"
    assert verdict.reached["dht"] >= 1


@pytest.mark.parametrize("closed", ["dht", "grpc", "data"])
def test_a_peer_with_any_port_unreachable_is_private(closed: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reach, "WAIT", 0.5)  # loopback: a dial-back that gets through does
    kinds = {"dht", "grpc", "data"} - {closed}
    verdict = asyncio.run(_verdict(kinds, None))
    assert verdict.state == reach.PRIVATE, verdict
    assert closed in verdict.why and verdict.reached[closed] == 0


def test_peers_that_see_our_own_address_make_us_public_without_waiting() -> None:
    verdict = asyncio.run(_verdict(set(), None, own=("127.0.0.1",)))  # every port closed
    assert verdict.state == reach.PUBLIC and "no NAT" in verdict.why


def test_nobody_answering_or_every_dialer_busy_leaves_it_unknown() -> None:
    async def body(answer: tuple[str, bool] | None) -> reach.Verdict:
        async def ask(contact: object, nonce: bytes) -> tuple[str, bool] | None:
            return answer
        return await Reachability().check([object(), object()], ask)
    assert asyncio.run(body(None)).state == reach.UNKNOWN
    assert asyncio.run(body(("192.0.2.1", False))).state == reach.UNKNOWN


def test_the_dialer_dials_each_address_once_at_a_time_and_within_its_rate() -> None:
    async def body() -> None:
        dialer = DialBack(None)
        with socket.socket() as s:  # a port nothing accepts on: dials take their time
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ports = (port, port, port)
        assert dialer.request(("127.0.0.2", 1), os.urandom(16), ports)
        assert not dialer.request(("127.0.0.2", 1), os.urandom(16), ports)  # one at a time
        granted = sum(dialer.request((f"127.0.1.{i}", 1), os.urandom(16), ports)
                      for i in range(1, 100))
        assert granted <= reach.DIAL_BURST
        assert dialer.refused >= 1 + 99 - granted
        await dialer.close()
    asyncio.run(body())


def test_one_lying_contact_can_neither_name_our_address_nor_make_us_private(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reach, "WAIT", 0.3)  # the liar never dials: no need to wait long
    async def body(answers: list[tuple[str, bool] | None]) -> reach.Verdict:
        it = iter(answers)

        async def ask(contact: object, nonce: bytes) -> tuple[str, bool] | None:
            return next(it)
        return await Reachability().check([object()] * len(answers), ask, ("10.0.0.5",))
    # a liar says it saw us elsewhere and will dial (it will not); the others are busy
    verdict = asyncio.run(body([("203.0.113.66", True), None, ("10.0.0.5", False)]))
    assert verdict.state == reach.UNKNOWN and verdict.observed == ""
    # nor can an empty or wildcard address pass for our own
    verdict = asyncio.run(body([("", False), ("0.0.0.0", False)]))
    assert verdict.state == reach.UNKNOWN


def test_a_dial_back_needs_the_cookie_its_address_was_given() -> None:
    async def body() -> None:
        dialer = DialBack(None)
        me, forger = ("192.0.2.7", 7700), ("192.0.2.8", 7700)
        cookie = dialer.cookie(me)
        assert dialer.cookie_ok(me, cookie)
        assert not dialer.cookie_ok(forger, cookie)  # another address
        assert not dialer.cookie_ok(me, b"\0" * 16)
        await dialer.close()
    asyncio.run(body())
