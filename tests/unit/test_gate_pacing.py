"""The gRPC gate's receive budget, over real loopback sockets on a virtual clock: each
connection has its own bucket, refilled at the address's rate shared among its connections,
a vouched connection is charged to its identity instead, new connections per address are
paced, and the gate waits exactly as long as the rates ask."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

import pytest

from moshpitd.buckets import Bucket
from moshpitd.transport.gate import ACCEPT_RATE, PACED, Gate, GateLimits

RATE, BURST = 1000, 1000


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.waits: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)


class Sink:
    """The gate's target: counts what each connection delivers, by the gate's port."""

    def __init__(self) -> None:
        self.got: Counter[int] = Counter()
        self.ports: list[int] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        port = int(writer.get_extra_info("peername")[1])
        self.ports.append(port)
        while data := await reader.read(1 << 16):
            self.got[port] += len(data)
        writer.close()


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.005)


def test_bucket_debt_is_paid_at_the_rate() -> None:
    b = Bucket(rate=100.0, burst=50.0, now=0.0)
    assert b.charge(50, 0.0) == 0.0
    assert b.charge(100, 0.0) == pytest.approx(1.0)  # 100 bytes in debt at 100 bytes/s
    assert b.charge(0, 1.0) == 0.0  # paid
    assert b.charge(50, 100.0) == 0.0  # refilled to the burst, not beyond


def test_connections_pay_their_own_debts_and_a_vouched_peer_its_identity() -> None:
    async def body() -> None:
        clock = VirtualClock()
        sink = Sink()
        target = await asyncio.start_server(sink.serve, "127.0.0.1", 0)
        refused: Counter[str] = Counter()
        gate = Gate(("127.0.0.1", target.sockets[0].getsockname()[1]),
                    GateLimits(rate=RATE, burst=BURST, accept_rate=1e-3, accept_burst=4),
                    lambda why: refused.update([why]), clock, clock.sleep)
        port = await gate.start("127.0.0.1", 0)

        def delivered(i: int) -> int:
            return sink.got[sink.ports[i]] if len(sink.ports) > i else 0

        try:
            # alone on its address, a connection sends 5 x its burst: 4 s at the whole rate
            _, a = await asyncio.open_connection("127.0.0.1", port)
            a.write(b"x" * 5 * BURST)
            await a.drain()
            await until(lambda: delivered(0) == 5 * BURST)
            assert sum(clock.waits) == pytest.approx(4.0)
            assert refused[PACED] >= 1
            # a second connection from the address does not wait for the first one's debt:
            # its burst passes at once, and past it, it has half the rate (two connections)
            _, b = await asyncio.open_connection("127.0.0.1", port)
            b.write(b"y" * BURST)
            await b.drain()
            await until(lambda: delivered(1) == BURST)
            assert sum(clock.waits) == pytest.approx(4.0)
            b.write(b"y" * BURST)
            await b.drain()
            await until(lambda: delivered(1) == 2 * BURST)
            assert sum(clock.waits) == pytest.approx(6.0)
            # a third, vouched after its first bytes: what follows is charged to its identity
            _, c = await asyncio.open_connection("127.0.0.1", port)
            c.write(b"z" * BURST)
            await c.drain()
            await until(lambda: delivered(2) == BURST)
            peer = f"ipv4:127.0.0.1:{sink.ports[2]}"
            assert gate.origin(peer) == "127.0.0.1" and not gate.vouched(peer)
            gate.vouch(peer, b"\x01" * 32)
            assert gate.vouched(peer)
            before = sum(clock.waits)
            c.write(b"z" * BURST)
            await c.drain()
            await until(lambda: delivered(2) == 2 * BURST)
            assert sum(clock.waits) == pytest.approx(before)  # the identity's own, full bucket
            # the address has opened 3 of its 4 at once, and 6 s at 1/1000 a second add
            # none: one more is taken, the next refused at once
            assert refused[ACCEPT_RATE] == 0
            _, d = await asyncio.open_connection("127.0.0.1", port)
            d.write(b"w")
            await d.drain()
            await until(lambda: delivered(3) == 1)
            r, e = await asyncio.open_connection("127.0.0.1", port)
            assert await asyncio.wait_for(r.read(), 10) == b""  # closed by the gate
            assert refused[ACCEPT_RATE] == 1 and len(sink.ports) == 4
            for w in (a, b, c, d, e):
                w.close()
        finally:
            await gate.close()
            target.close()

    asyncio.run(body())
