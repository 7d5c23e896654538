"""The data-plane listener and the rounds it routes incoming streams to.

A sender may connect before the reducer has even learnt of the group (the leader's GroupInfo
reaches members in any order), so a stream that names an unknown group waits a little for it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from moshpitd.allreduce.butterfly import ButterflyRound
from moshpitd.auth import OVERHEAD, AuthError, ReplayCache, SwarmKey
from moshpitd.transport.dataplane import (
    HELLO,
    READY,
    Channel,
    DataPlaneError,
    FrameSink,
    connect,
    serve,
    split_endpoint,
)

log = logging.getLogger(__name__)

MAX_FINISHED = 4096  # ended rounds remembered, to refuse their late streams at once
# A protocol constant, not a round's deadline: a connection that names no round within this is
# dropped whatever round it might have been for (it holds a descriptor and a MAX_UNOPENED slot).
HELLO_TIMEOUT = 10.0
MAX_UNOPENED = 1024
MAX_PENDING = 1024


class _Hello:
    """The first frame on an incoming stream says which round and which sender it is."""

    def __init__(self, registry: RoundRegistry) -> None:
        self.registry = registry
        self.channel: Channel | None = None
        self.greeted = False
        registry.unopened += 1
        self._timer = asyncio.get_running_loop().call_later(HELLO_TIMEOUT, self._too_slow)

    def _too_slow(self) -> None:
        if self.channel is not None:  # a connection that never says who it is: drop it
            self.channel.abort(f"no HELLO within {HELLO_TIMEOUT:.0f} s")

    def _opened(self) -> None:
        if not self.greeted:
            self.greeted = True
            self.registry.unopened -= 1
            self._timer.cancel()

    def buffer_for(self, kind: int, part: int, length: int, aux: int) -> memoryview | None:
        if kind != HELLO or length != self.registry.hello_length:
            if self.registry.auth is not None:
                self.registry.rejected += 1
            raise DataPlaneError("a stream must open with HELLO"
                                 + (" sealed with the swarm key" if self.registry.auth else ""))
        return None

    def on_frame(self, kind: int, part: int, payload: memoryview, aux: int) -> None:
        assert self.channel is not None and self.channel.transport is not None
        self._opened()
        group_id = bytes(payload)
        auth = self.registry.auth
        if auth is not None:
            try:  # bound to sender and receiver: a copied HELLO opens no other stream
                group_id = auth.open(b"data", _hello_context(aux, part), group_id,
                                     self.registry.replay)
            except AuthError as exc:
                self.registry.rejected += 1
                raise DataPlaneError(f"unauthenticated data-plane stream: {exc}") from None
        self.channel.transport.pause_reading()
        task = asyncio.ensure_future(self.registry.route(self.channel, group_id, aux, part))
        self.registry.tasks.add(task)
        task.add_done_callback(self.registry.tasks.discard)

    def on_close(self, exc: BaseException | None) -> None:
        self._opened()


class _Refused(Channel):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        transport.close()


def _hello_context(sender: int, receiver: int) -> bytes:
    return (b"hello" + (sender & 0xFFFFFFFF).to_bytes(4, "big")
            + (receiver & 0xFFFFFFFF).to_bytes(4, "big"))


class RoundRegistry:
    def __init__(self, max_payload: int, auth: SwarmKey | None = None,
                 stream_wait: float = 10.0) -> None:
        self.max_payload = max_payload
        self.stream_wait = stream_wait  # see clock.stream_wait
        self.auth = auth
        self.replay = ReplayCache()
        self.hello_length = 16 + (OVERHEAD if auth is not None else 0)
        self.unopened = 0  # accepted connections that have not sent their HELLO yet
        self.rejected = 0  # HELLOs without a valid swarm-key tag
        self._rounds: dict[bytes, asyncio.Future[ButterflyRound]] = {}
        # rounds that ended here: a late stream for one is refused at once, so its sender
        # stops waiting for us instead of waiting stream_wait (insertion-ordered, bounded)
        self._finished: dict[bytes, None] = {}
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int) -> int:
        def accept() -> Channel:
            if self.unopened >= MAX_UNOPENED:  # a flood of idle connections: refuse new ones
                return _Refused(None, 0)
            hello = _Hello(self)
            channel = Channel(hello, self.max_payload)
            hello.channel = channel
            return channel

        self.server = await serve(host, port, accept)
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self.tasks):
            task.cancel()

    def hello(self, group_id: bytes, sender: int, receiver: int) -> bytes:
        """The HELLO payload that opens our stream to a reducer (sealed with the swarm key:
        the data plane only takes streams from daemons of the swarm)."""
        if self.auth is None:
            return group_id
        return self.auth.seal(b"data", _hello_context(sender, receiver), group_id)

    async def connect(self, endpoint: str, sink: FrameSink) -> Channel:
        host, port = split_endpoint(endpoint)
        return await connect(host, port, sink, self.max_payload)

    def _future(self, group_id: bytes) -> asyncio.Future[ButterflyRound]:
        fut = self._rounds.get(group_id)
        if fut is None:
            if len(self._rounds) >= MAX_PENDING:
                raise DataPlaneError("too many pending groups")
            fut = asyncio.get_running_loop().create_future()
            self._rounds[group_id] = fut
        return fut

    def register(self, rnd: ButterflyRound) -> None:
        fut = self._future(rnd.group.group_id)
        if not fut.done():
            fut.set_result(rnd)

    def unregister(self, group_id: bytes) -> None:
        self._rounds.pop(group_id, None)
        self._finished[group_id] = None
        while len(self._finished) > MAX_FINISHED:
            del self._finished[next(iter(self._finished))]

    async def route(self, channel: Channel, group_id: bytes, sender: int,
                    receiver: int) -> None:
        started = time.monotonic()
        try:
            if group_id in self._finished:
                raise DataPlaneError(f"group {group_id.hex()[:8]}'s round is over here")
            fut = self._future(group_id)
            async with asyncio.timeout(self.stream_wait):
                rnd = await asyncio.shield(fut)
            if receiver != rnd.me:
                raise DataPlaneError(f"stream meant for member {receiver}, this is {rnd.me}")
            channel.sink = rnd.accept(sender, channel)
            channel.send_nowait(READY, rnd.me)
        except (TimeoutError, DataPlaneError) as exc:
            pending = self._rounds.get(group_id)
            if pending is not None and not pending.done():
                del self._rounds[group_id]
            why = str(exc) or f"no group {group_id.hex()[:8]} here after {self.stream_wait:.0f} s"
            log.info("refusing stream from member %d: %s (waited %.2fs)", sender, why,
                     time.monotonic() - started)
            channel.abort(why)
            return
        if channel.transport is not None and not channel.transport.is_closing():
            channel.transport.resume_reading()
