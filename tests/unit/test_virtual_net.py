"""moshpitd/virtual: the loop's clock jumps, links delay and queue, streams keep order and
push back, control calls end as gRPC's do."""

from __future__ import annotations

import asyncio

import pytest

from moshpitd import timebase
from moshpitd.proto import moshpit_pb2 as pb
from moshpitd.transport import control
from moshpitd.transport.control import Caller, ControlError
from moshpitd.virtual import loop as vloop
from moshpitd.virtual.control import virtual_plane
from moshpitd.virtual.net import EPOCH, Host, Link, Network

SLOW = Link(delay=0.05, up=1e6, down=1e6)  # 100 ms round trips, 1 MB/s


def two_hosts(link: Link = SLOW) -> tuple[Network, Host, Host]:
    net = Network(asyncio.get_running_loop(), seed=1)  # type: ignore[arg-type]
    return net, net.add_host(link), net.add_host(link, clock_offset=7.0)


def test_waits_cost_no_real_time_and_each_host_reads_its_own_clock() -> None:
    async def main() -> tuple[float, float, float]:
        net, a, b = two_hosts()

        async def clocks() -> tuple[float, float]:
            await asyncio.sleep(3600)
            return timebase.monotonic(), timebase.wall()
        (mono_a, wall_a), (mono_b, wall_b) = await asyncio.gather(a.start(clocks()),
                                                                  b.start(clocks()))
        assert mono_a == mono_b == pytest.approx(3600)
        return wall_a, wall_b, net.loop.time()
    wall_a, wall_b, now = vloop.run(main)
    assert wall_a == pytest.approx(EPOCH + 3600) and wall_b == pytest.approx(wall_a + 7.0)
    assert now == pytest.approx(3600)


def test_a_wait_for_what_never_comes_is_a_deadlock_not_a_hang() -> None:
    async def main() -> None:
        await asyncio.get_running_loop().create_future()
    with pytest.raises(vloop.Deadlock):
        vloop.run(main)


def test_datagrams_cross_the_link_at_its_delay_and_rate() -> None:
    async def main() -> list[tuple[float, int]]:
        net, a, b = two_hosts()
        got: list[tuple[float, int]] = []
        both = net.loop.create_future()

        class Rx(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
                got.append((net.loop.time(), len(data)))
                if len(got) == 2:
                    both.set_result(None)

        async def setup() -> None:
            await net.loop.create_datagram_endpoint(Rx, local_addr=(b.ip, 9000))
        await b.start(setup())

        async def send() -> None:
            tx, _ = await net.loop.create_datagram_endpoint(asyncio.DatagramProtocol,
                                                            local_addr=(a.ip, 0))
            for _ in range(2):
                tx.sendto(bytes(972), (b.ip, 9000))
        await a.start(send())
        await both
        return got
    got = vloop.run(main)
    # 1000 bytes on the wire each: 1 ms up, 100 ms of delay, 1 ms down; the second queues
    assert [n for _, n in got] == [972, 972]
    assert got[0][0] == pytest.approx(0.102) and got[1][0] == pytest.approx(0.103)


def test_a_stream_keeps_order_and_pushes_back_on_a_slow_uplink() -> None:
    async def main() -> tuple[bytes, float, int]:
        net, a, b = two_hosts()
        received = bytearray()
        done = net.loop.create_future()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            received.extend(await reader.read())
            writer.close()
            done.set_result(net.loop.time())

        async def listen() -> None:
            await asyncio.start_server(serve, b.ip, 7000)
        await b.start(listen())
        most_queued = 0

        async def send() -> None:
            nonlocal most_queued
            _, writer = await asyncio.open_connection(b.ip, 7000)
            for i in range(20):
                writer.write(bytes([i]) * 50_000)
                most_queued = max(most_queued, writer.transport.get_write_buffer_size())
                await writer.drain()
            writer.close()
        await a.start(send())
        finished = await done
        return bytes(received), finished, most_queued
    data, finished, most_queued = vloop.run(main)
    assert data == b"".join(bytes([i]) * 50_000 for i in range(20))
    # connected after a round trip (0.2 s), 1 MB leaves at 1 MB/s (1.2 s); the last segment
    # crosses 100 ms of delay and the receiver's downlink (50 ms)
    assert finished == pytest.approx(1.35, abs=0.01)
    assert most_queued <= 64 * 1024 + 50_000  # drain() waited: the uplink's queue stayed short


def test_a_connection_to_a_closed_port_is_refused_after_a_round_trip() -> None:
    async def main() -> float:
        net, a, b = two_hosts()

        async def dial() -> float:
            with pytest.raises(ConnectionRefusedError):
                await asyncio.open_connection(b.ip, 1)
            return net.loop.time()
        return await a.start(dial())
    assert vloop.run(main) == pytest.approx(0.2)


def test_control_calls_answer_fail_and_time_out_as_grpc_calls_do() -> None:
    async def join(request: pb.JoinRequest, caller: Caller):  # type: ignore[no-untyped-def]
        if request.group_key == "refuse":
            raise ControlError(control.EXHAUSTED, "too many")
        if request.group_key == "hang":
            await asyncio.sleep(3600)
        yield pb.JoinResponse(message=f"hello {caller.address.split(':')[1]}")

    async def state(request: pb.StateRequest, caller: Caller):  # type: ignore[no-untyped-def]
        yield pb.StateChunk()

    async def main() -> list[object]:
        net, a, b = two_hosts()

        async def serve() -> int:
            server, _ = virtual_plane(net)(join, state)
            return await server.start(b.ip, 0)
        port = await b.start(serve())

        async def calls() -> list[object]:
            _, pool = virtual_plane(net)(join, state)
            out: list[object] = []
            for key in ("ok", "refuse", "hang"):
                call = pool.join(f"{b.ip}:{port}", pb.JoinRequest(group_key=key), timeout=1.0)
                try:
                    out.append([r.message async for r in call])
                except ControlError as exc:
                    out.append(exc.kind)
                out.append(round(net.loop.time(), 3))
            b.kill()
            call = pool.join(f"{b.ip}:{port}", pb.JoinRequest(group_key="ok"), timeout=1.0)
            try:
                await call.read()
            except ControlError as exc:
                out.append(exc.kind)
            return out
        return await a.start(calls())
    # a round trip each (200 ms), the hanging one its whole timeout; a dead host resets
    assert vloop.run(main) == [["hello 10.0.0.1"], 0.2, control.EXHAUSTED, 0.4,
                               control.DEADLINE, 1.4, control.UNAVAILABLE]
