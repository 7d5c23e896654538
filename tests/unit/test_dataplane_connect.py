"""A data-plane connection races a second attempt when the first is not up in time (a lost
SYN waits out the kernel's 1 s retransmission timeout): real sockets on loopback, with the
first attempt held back the way a lost SYN holds it."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import pytest

from moshpitd.transport import dataplane
from moshpitd.transport.dataplane import Channel, connect


class Sink:
    def __init__(self) -> None:
        self.closed: list[BaseException | None] = []

    def buffer_for(self, kind: int, part: int, length: int, aux: int) -> None:
        return None

    def on_frame(self, kind: int, part: int, payload: memoryview, aux: int) -> None:
        pass

    def on_close(self, exc: BaseException | None) -> None:
        self.closed.append(exc)


async def serve() -> tuple[asyncio.Server, int, list[Channel]]:
    accepted: list[Channel] = []

    def accept() -> Channel:
        ch = Channel()
        accepted.append(ch)
        return ch
    server = await asyncio.get_running_loop().create_server(accept, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], accepted


def held_first(monkeypatch: pytest.MonkeyPatch, hold: asyncio.Event,
               cancelled: asyncio.Event | None = None) -> list[float]:
    """The loop's create_connection, with its first call waiting for `hold` (a lost SYN);
    `cancelled` is set if that wait is cancelled."""
    loop = asyncio.get_running_loop()
    real = loop.create_connection
    calls: list[float] = []

    async def create_connection(*args: Any, **kwargs: Any) -> Any:
        calls.append(time.monotonic())
        if len(calls) == 1:
            try:
                await hold.wait()
            except asyncio.CancelledError:
                if cancelled is not None:
                    cancelled.set()
                raise
        return await real(*args, **kwargs)
    monkeypatch.setattr(loop, "create_connection", create_connection)
    return calls


def test_a_connect_that_is_up_at_once_never_races(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> tuple[int, int]:
        server, port, accepted = await serve()
        calls = held_first(monkeypatch, asyncio.Event())
        calls.append(0.0)  # the next call is not the held one
        ch = await connect("127.0.0.1", port, Sink(), 1 << 20, hedge_after=0.2)
        assert ch.transport is not None and not ch.transport.is_closing()
        n = len(calls) - 1
        ch.transport.close()
        server.close()
        return n, len(accepted)
    assert asyncio.run(scenario()) == (1, 1)


def test_a_held_first_attempt_loses_to_the_second_and_never_reaches_the_sink(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        server, port, accepted = await serve()
        hold, cancelled = asyncio.Event(), asyncio.Event()
        calls = held_first(monkeypatch, hold, cancelled)
        sink = Sink()
        started = time.monotonic()
        ch = await connect("127.0.0.1", port, sink, 1 << 20, hedge_after=0.2)
        took = time.monotonic() - started
        # the hedge's clock starts when connect does, a loop pass before the first attempt
        # runs (on a loaded machine that pass can take longer than the margin)
        assert len(calls) == 2 and calls[1] - started >= 0.2, (started, calls)
        assert 0.2 <= took < 1.0, took  # the hedge, not the kernel's 1 s
        assert ch.sink is sink and ch.transport is not None and not ch.transport.is_closing()
        await asyncio.wait_for(cancelled.wait(), 5)  # the held attempt is given up
        hold.set()
        assert len(accepted) == 1, accepted
        ch.transport.close()
        await ch.gone
        assert len(sink.closed) == 1  # only the winner's close reaches the sink
        server.close()
    asyncio.run(scenario())


@pytest.mark.parametrize("released", [True, False], ids=["up-with-the-winner", "cancelled"])
def test_a_loser_whose_connection_was_made_is_closed_and_never_tells_the_sink(
        monkeypatch: pytest.MonkeyPatch, released: bool) -> None:
    """The first attempt's connection is made, but its attempt has not returned when the
    second is up: it returns together with the second (`released`), or is still pending (a
    stalled loop) and gets cancelled, which closes that connection. Either way the loser is
    closed, and the sink, shared with the winner, never hears of it (it would take the
    winner's stream for gone and the round would keep local values)."""
    async def scenario() -> None:
        server, port, accepted = await serve()
        loop = asyncio.get_running_loop()
        real = loop.create_connection
        second_up = asyncio.Event()
        made: list[Channel] = []

        async def create_connection(*args: Any, **kwargs: Any) -> Any:
            out = await real(*args, **kwargs)
            made.append(out[1])
            if len(made) == 2 and released:
                second_up.set()
            if len(made) == 1 or released:
                await second_up.wait()  # connected, but the attempt is not done
            return out
        monkeypatch.setattr(loop, "create_connection", create_connection)
        sink = Sink()
        ch = await connect("127.0.0.1", port, sink, 1 << 20, hedge_after=0.1)
        assert len(made) == 2 and ch in made
        if not released:
            assert ch is made[1]
        loser = made[1] if ch is made[0] else made[0]
        await asyncio.wait_for(loser.gone, 5)
        assert sink.closed == [] and loser.sink is None
        assert ch.transport is not None and not ch.transport.is_closing()
        assert len(accepted) == 2
        ch.transport.close()
        await ch.gone
        assert len(sink.closed) == 1
        server.close()
    asyncio.run(scenario())


def test_when_both_attempts_fail_the_first_s_error_is_raised(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        calls: list[int] = []

        async def create_connection(*args: Any, **kwargs: Any) -> Any:
            calls.append(len(calls))
            if len(calls) == 1:
                await asyncio.sleep(0.15)
                raise ConnectionRefusedError("first")
            raise ConnectionRefusedError("second")
        monkeypatch.setattr(loop, "create_connection", create_connection)
        with pytest.raises(ConnectionRefusedError, match="first"):
            await connect("127.0.0.1", 9, Sink(), 1 << 20, hedge_after=0.1)
        assert len(calls) == 2
    asyncio.run(scenario())


def test_the_default_hedge_is_well_under_the_kernel_s_syn_timeout() -> None:
    assert 0.05 <= dataplane.HEDGE_AFTER <= 0.5


def _available() -> list[str]:
    try:
        with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
            return f.read().split()
    except OSError:
        return []


@pytest.mark.skipif(not hasattr(socket, "TCP_CONGESTION") or not _available(),
                    reason="needs Linux's TCP_CONGESTION and its list of algorithms")
def test_a_connection_takes_the_congestion_control_asked_for(
        caplog: pytest.LogCaptureFixture) -> None:
    want = "reno"  # built into every Linux kernel, and nobody's default
    monkey = "no-such-algorithm"

    async def main() -> tuple[str, str]:
        server, port, _ = await serve()
        ch = await connect("127.0.0.1", port, Sink(), 1 << 20, congestion=want)
        odd = await connect("127.0.0.1", port, Sink(), 1 << 20, congestion=monkey)
        again = await connect("127.0.0.1", port, Sink(), 1 << 20, congestion=monkey)
        names = []
        for c in (ch, odd):
            assert c.transport is not None
            sock = c.transport.get_extra_info("socket")
            names.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
                         .rstrip(b"\0").decode())
        for c in (ch, odd, again):
            c.close()
        server.close()
        return names[0], names[1]

    ours, fallback = asyncio.run(main())
    assert ours == want
    assert fallback in _available()  # the host's default stays
    warned = [r for r in caplog.records if monkey in r.getMessage()]
    assert len(warned) == 1  # once, not per connection


@pytest.mark.skipif(not hasattr(socket, "TCP_KEEPIDLE"), reason="needs TCP_KEEPIDLE (Linux)")
def test_both_ends_keep_an_idle_connection_alive() -> None:
    """A kept session idles between rounds: keepalive probes hold it open through NAT and
    let the kernel drop one whose peer vanished (transport/tcp.py)."""
    from moshpitd.transport.tcp import KEEPALIVE_IDLE

    async def main() -> list[tuple[int, int]]:
        server, port, accepted = await serve()
        ch = await connect("127.0.0.1", port, Sink(), 1 << 20)
        async with asyncio.timeout(5):  # the server side's connection_made
            while not accepted or accepted[0].transport is None:
                await asyncio.sleep(0.001)
        got = []
        for c in (ch, accepted[0]):
            assert c.transport is not None
            sock = c.transport.get_extra_info("socket")
            got.append((sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)))
            c.close()
        server.close()
        return got

    assert asyncio.run(main()) == [(1, KEEPALIVE_IDLE)] * 2
