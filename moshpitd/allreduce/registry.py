"""The data-plane listener and the rounds it routes incoming streams to.

A sender may connect before the reducer has even learnt of the group (the leader's GroupInfo
reaches members in any order), so a stream that names an unknown group waits a little for it.

Admission: a stream for a group we hold (a round registered here) is admitted at once, whatever
else is waiting. Streams for groups we do not know share one small table (MAX_STRANGERS); when
it is full, a new one is refused with BUSY and its sender opens it again a moment later, by
which time a legitimate group is ours. So strangers that fill the table (a flood of HELLOs with
made-up group ids) delay nobody's round and refuse none. Connections that have not said HELLO
yet are bounded too, the oldest dropped first: a legitimate one says HELLO at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

from moshpitd.allreduce.butterfly import ButterflyRound
from moshpitd.transport.dataplane import (
    BUSY,
    HELLO,
    READY,
    Channel,
    DataPlaneError,
    FrameSink,
    connect,
    serve,
    split_endpoint,
)
from moshpitd.transport.handshake import Handshake, HandshakeError, Hello, UnsealedHello

log = logging.getLogger(__name__)

MAX_FINISHED = 4096  # ended rounds remembered, to refuse their late streams at once
# A protocol constant, not a round's deadline: a connection that names no round within this is
# dropped whatever round it might have been for (it holds a descriptor and a MAX_UNOPENED slot).
HELLO_TIMEOUT = 10.0
MAX_UNOPENED = 1024
# Streams waiting for a group we do not hold. Legitimate ones wait a few ms (until our
# matchmaking hands us the group); a stream refused for room comes again (sender.py).
MAX_STRANGERS = 64

# why a stream was refused: the `reason` of moshpitd_data_streams_refused_total
REFUSED_BUSY = "busy"  # unknown group, and no room to wait
REFUSED_IDENTITY = "identity"  # its handshake does not prove it is the member it names
REFUSED_HANDSHAKE = "handshake"  # malformed, stale, or another encryption setting
REFUSED_GROUP = "group"  # no such group here in time, the round is over, or not for us


class _Hello:
    """The first frame on an incoming stream says which round and which sender it is."""

    def __init__(self, registry: RoundRegistry) -> None:
        self.registry = registry
        self.channel: Channel | None = None
        self.greeted = False
        registry.unopened[self] = None
        self._timer = asyncio.get_running_loop().call_later(HELLO_TIMEOUT, self._too_slow)

    def _too_slow(self) -> None:
        self.drop(f"no HELLO within {HELLO_TIMEOUT:.0f} s")

    def drop(self, why: str) -> None:
        if self.channel is not None:  # a connection that never says who it is: drop it
            self.channel.abort(why)
        self._opened()

    def _opened(self) -> None:
        if not self.greeted:
            self.greeted = True
            self.registry.unopened.pop(self, None)
            self._timer.cancel()

    def buffer_for(self, kind: int, part: int, length: int, aux: int) -> memoryview | None:
        if kind != HELLO or length != self.registry.handshake.hello_length:
            self.registry.refused[REFUSED_HANDSHAKE] += 1
            if self.registry.handshake.swarm is not None:
                self.registry.rejected += 1
            raise DataPlaneError("a stream must open with HELLO" + (
                " sealed with the swarm key" if self.registry.handshake.swarm else ""))
        return None

    def on_frame(self, kind: int, part: int, payload: memoryview, aux: int) -> None:
        assert self.channel is not None and self.channel.transport is not None
        self._opened()
        try:
            hello = self.registry.handshake.open_hello(payload, aux, part)
        except UnsealedHello as exc:
            self.registry.rejected += 1
            self.registry.refused[REFUSED_HANDSHAKE] += 1
            raise DataPlaneError(str(exc)) from None
        except HandshakeError as exc:
            self.registry.refused[REFUSED_HANDSHAKE] += 1
            raise DataPlaneError(f"refused handshake: {exc}") from None
        self.channel.transport.pause_reading()
        task = asyncio.ensure_future(self.registry.route(self.channel, hello, aux, part))
        self.registry.tasks.add(task)
        task.add_done_callback(self.registry.tasks.discard)

    def on_close(self, exc: BaseException | None) -> None:
        self._opened()


class _Refused(Channel):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        transport.close()


class RoundRegistry:
    def __init__(self, max_payload: int, handshake: Handshake | None = None,
                 stream_wait: float = 10.0, max_strangers: int = MAX_STRANGERS) -> None:
        self.max_payload = max_payload
        self.stream_wait = stream_wait  # see clock.stream_wait
        self.handshake = handshake or Handshake()
        self.max_strangers = max_strangers
        self.unopened: dict[_Hello, None] = {}  # connections without HELLO yet, oldest first
        self.rejected = 0  # HELLOs without a valid swarm-key tag
        self.refused: Counter[str] = Counter()  # streams refused, by reason
        self._rounds: dict[bytes, ButterflyRound] = {}  # groups we hold: admitted first
        self._waiting: dict[bytes, asyncio.Future[ButterflyRound]] = {}  # strangers' groups
        self._waiters: Counter[bytes] = Counter()  # streams waiting, per stranger group
        self.strangers = 0  # streams waiting for a group we do not hold
        # rounds that ended here: a late stream for one is refused at once, so its sender
        # stops waiting for us instead of waiting stream_wait (insertion-ordered, bounded)
        self._finished: dict[bytes, None] = {}
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int) -> int:
        def accept() -> Channel:
            if len(self.unopened) >= MAX_UNOPENED:  # idle connections: drop the oldest
                next(iter(self.unopened)).drop("too many connections without a HELLO")
                if len(self.unopened) >= MAX_UNOPENED:  # (not yet connected: cannot drop)
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

    async def connect(self, endpoint: str, sink: FrameSink) -> Channel:
        host, port = split_endpoint(endpoint)
        return await connect(host, port, sink, self.max_payload)

    def register(self, rnd: ButterflyRound) -> None:
        """A round of ours: its streams are admitted from now on, and those already waiting
        for it go to it."""
        gid = rnd.group.group_id
        self._rounds[gid] = rnd
        fut = self._waiting.pop(gid, None)
        if fut is not None and not fut.done():
            fut.set_result(rnd)

    def unregister(self, group_id: bytes) -> None:
        self._rounds.pop(group_id, None)
        self._finished[group_id] = None
        while len(self._finished) > MAX_FINISHED:
            del self._finished[next(iter(self._finished))]

    async def _round_for(self, group_id: bytes) -> ButterflyRound:
        """Our round of `group_id`, waiting for it (as a stranger) if we do not hold it yet."""
        rnd = self._rounds.get(group_id)
        if rnd is not None:
            return rnd
        if group_id in self._finished:
            raise DataPlaneError(f"group {group_id.hex()[:8]}'s round is over here")
        if self.strangers >= self.max_strangers:
            raise _Busy(f"{self.strangers} streams already wait for groups unknown here")
        fut = self._waiting.get(group_id)
        if fut is None:
            fut = self._waiting[group_id] = asyncio.get_running_loop().create_future()
        self.strangers += 1
        self._waiters[group_id] += 1
        try:
            async with asyncio.timeout(self.stream_wait):
                return await asyncio.shield(fut)
        except TimeoutError:
            raise DataPlaneError(f"no group {group_id.hex()[:8]} here after "
                                 f"{self.stream_wait:.0f} s") from None
        finally:
            self.strangers -= 1
            self._waiters[group_id] -= 1
            if self._waiters[group_id] <= 0:
                del self._waiters[group_id]
                if not fut.done() and self._waiting.get(group_id) is fut:
                    del self._waiting[group_id]

    async def route(self, channel: Channel, hello: Hello, sender: int, receiver: int) -> None:
        started = time.monotonic()
        try:
            rnd = await self._round_for(hello.group_id)
            if receiver != rnd.me:
                raise DataPlaneError(f"stream meant for member {receiver}, this is {rnd.me}")
            rnd.reducer.check_sender(sender)
            try:
                ready, cipher = self.handshake.accept(hello, rnd.group, sender, rnd.me)
            except HandshakeError as exc:
                raise _NotThem(str(exc)) from None
            channel.sink = rnd.accept(sender, channel)
            channel.send_nowait(READY, rnd.me, ready)  # the last frame in the clear
            channel.cipher = cipher
        except _Busy as exc:
            self.refused[REFUSED_BUSY] += 1
            log.debug("refusing stream from member %d: %s", sender, exc)
            channel.abort(f"busy: {exc}; open the stream again", code=BUSY)
            return
        except _NotThem as exc:  # counted, not logged above DEBUG: any key holder can send it
            self.refused[REFUSED_IDENTITY] += 1
            log.debug("refusing stream as member %d: %s", sender, exc)
            channel.abort(f"refused: {exc}")
            return
        except DataPlaneError as exc:
            self.refused[REFUSED_GROUP] += 1
            log.info("refusing stream from member %d: %s (waited %.2fs)", sender, exc,
                     time.monotonic() - started)
            channel.abort(str(exc))
            return
        if channel.transport is not None and not channel.transport.is_closing():
            channel.transport.resume_reading()


class _Busy(DataPlaneError):
    """No room to wait for a group we do not hold."""


class _NotThem(DataPlaneError):
    """The handshake does not prove the stream is the member it names."""
