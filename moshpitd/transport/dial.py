"""Opening, serving and ending the data plane's connections (transport/dataplane.py's
`Channel`): a connect that races a second attempt when the first is slow, the listening side,
and an end that lets ABORTs reach their peers."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from moshpitd.transport.dataplane import Channel, FrameSink


async def flush_aborts(channels: list[Channel], timeout: float) -> None:
    """Until the ABORTs sent on these channels are out, or `timeout`: an ABORT is queued
    behind the frames written before it, and `close` would drop them all, so the peer would see
    the stream drop instead of hearing why. The frames ahead of it are views of the trainer's
    buffer: call this before the round returns, while the buffer is still the round's."""
    pending = [ch.gone for ch in channels if ch.aborted and not ch.gone.done()]
    if pending:
        await asyncio.wait(pending, timeout=timeout)


# s before a second connection attempt races the first. A lost SYN (or SYN-ACK) is resent
# after the kernel's initial retransmission timeout, 1 s, and every part of that member waits
# with it: on a 1 % lossy link, about one round in four had a member that late. Connections
# are usually up within a round trip; this is more than that on almost any path, so a healthy
# connect never races, and a lost SYN costs this instead of a second.
HEDGE_AFTER = 0.25


async def connect(host: str, port: int, sink: FrameSink, max_payload: int,
                  hedge_after: float = HEDGE_AFTER, congestion: str = "") -> Channel:
    """A connection to a peer's data plane: the first of two attempts to be up, the second
    started only if the first is not up after `hedge_after`. The loser never reaches the
    sink, whenever it is given up; an error is raised only when both attempts failed."""
    loop = asyncio.get_running_loop()
    made: dict[asyncio.Future[Channel], list[Channel]] = {}

    def attempt() -> asyncio.Future[Channel]:
        channels: list[Channel] = []

        def channel() -> Channel:  # it exists (and may be connected) before the result does
            channels.append(Channel(sink, max_payload, congestion))
            return channels[-1]

        async def run() -> Channel:
            return (await loop.create_connection(channel, host, port))[1]
        task = asyncio.ensure_future(run())
        made[task] = channels
        return task

    def discard(loser: asyncio.Future[Channel]) -> None:
        """Cut from the sink before anything closes it: a connection that asyncio closes
        because its attempt was cancelled must not tell the sink its stream is gone."""
        for ch in made[loser]:
            ch.sink = None
            if ch.transport is not None:
                ch.transport.close()
        if not loser.done():
            loser.cancel()
            loser.add_done_callback(lambda _: discard(loser))

    first = attempt()
    try:
        done, _ = await asyncio.wait({first}, timeout=hedge_after)
    except asyncio.CancelledError:
        discard(first)
        raise
    if done:
        return first.result()
    tries = [first, attempt()]
    pending = set(tries)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            won = next((t for t in done if t.exception() is None), None)
            if won is not None:
                for other in tries:
                    if other is not won:
                        discard(other)
                return won.result()
    except asyncio.CancelledError:
        for t in tries:
            discard(t)
        raise
    return tries[0].result()  # both failed: the first attempt's error


async def serve(host: str, port: int, accept: Callable[[], Channel]) -> asyncio.Server:
    loop = asyncio.get_running_loop()
    return await loop.create_server(accept, host, port, reuse_address=True)


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)
