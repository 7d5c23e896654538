"""The data-plane listener and the rounds it routes incoming streams to.

A sender may connect before the reducer has even learnt of the group (the leader's GroupInfo
reaches members in any order), so a stream that names an unknown group waits a little for it.

Admission: a stream for a group we hold (a round registered here) is admitted at once, whatever
else is waiting. Streams for groups we do not know share one small table (MAX_STRANGERS); when
it is full, a new one is refused with BUSY and its sender opens it again a moment later, by
which time a legitimate group is ours. One address holds at most half the table (its HELLOs'
signatures cannot be checked before the group is known, so there is no identity to count by
yet): a flood of HELLOs with made-up group ids from one host leaves the other half to every
other host, and its streams wait for no legitimate one. Connections that have not said HELLO
yet are bounded too, the oldest dropped first: a legitimate one says HELLO at once.

Sessions (transport/session.py): a stream that ended cleanly leaves its connection open. The
connections we opened wait in `pool` for our next stream to that peer; those we accepted wait
here, idle, for the opener's ATTACH, which is routed like a HELLO (it may name a group we do not
hold yet) and admitted without a handshake: the session already proved who is at its other end,
so it is taken only as a member with that peer id, for a group with that digest. Idle sessions
are bounded (MAX_IDLE, the oldest closed first) and close after ACCEPTED_IDLE_SECONDS.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from moshpitd import timebase
from moshpitd.allreduce.accepted import Resume, evict
from moshpitd.allreduce.butterfly import ButterflyRound
from moshpitd.transport.dataplane import (
    BUSY,
    HELLO,
    READY,
    RELAY,
    Channel,
    DataPlaneError,
    FrameSink,
    connect,
    serve,
    split_endpoint,
)
from moshpitd.transport.handshake import Handshake, HandshakeError, Hello, UnsealedHello
from moshpitd.transport.session import (
    ACCEPTED_IDLE_SECONDS,
    MAX_IDLE,
    MAX_PER_PEER,
    Attach,
    SessionPool,
    stream_context,
)

log = logging.getLogger(__name__)


class Offers(Protocol):
    def has(self, endpoint: str, peer_id: bytes) -> bool: ...

    def take(self, endpoint: str, peer_id: bytes) -> Channel | None: ...

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
        self.waiting: _Waiting | None = None  # while it waits for its group
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
        if kind == RELAY and self.registry.relay is not None:  # reservations, dial-backs
            return None
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
        if kind == RELAY and self.registry.relay is not None:
            self.registry.relay(self.channel, aux, bytes(payload))
            return
        try:
            hello = self.registry.handshake.open_hello(payload, aux, part)
        except UnsealedHello as exc:
            self.registry.rejected += 1
            self.registry.refused[REFUSED_HANDSHAKE] += 1
            raise DataPlaneError(str(exc)) from None
        except HandshakeError as exc:
            self.registry.refused[REFUSED_HANDSHAKE] += 1
            raise DataPlaneError(f"refused handshake: {exc}") from None
        self.channel.transport.pause_reading()  # until it is attached to its round
        self.registry.route(self.channel, hello, aux, part, self)

    def on_close(self, exc: BaseException | None) -> None:
        self._opened()
        if self.waiting is not None:  # gone while it waited: its room is free again
            self.registry.forget(self.waiting)


@dataclass(eq=False)
class _Waiting:
    """A stream that waits for a group we do not hold yet."""

    channel: Channel
    hello: Hello | Attach
    sender: int
    receiver: int
    since: float
    sink: _Hello | Resume | None = None
    timer: asyncio.TimerHandle | None = None
    address: str = ""  # the remote host it came from


class _Refused(Channel):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        transport.close()


class RoundRegistry:
    def __init__(self, max_payload: int, handshake: Handshake | None = None,
                 stream_wait: float = 10.0, max_strangers: int = MAX_STRANGERS,
                 congestion: str = "") -> None:
        self.max_payload = max_payload
        self.congestion = congestion  # TCP congestion control of every data connection
        self.stream_wait = stream_wait  # see clock.stream_wait
        self.handshake = handshake or Handshake()
        self.max_strangers = max_strangers
        self.unopened: dict[_Hello, None] = {}  # connections without HELLO yet, oldest first
        self.rejected = 0  # HELLOs without a valid swarm-key tag
        self.refused: Counter[str] = Counter()  # streams refused, by reason
        self._rounds: dict[bytes, ButterflyRound] = {}  # groups we hold: admitted first
        self._waiting: dict[bytes, list[_Waiting]] = {}  # streams of groups we do not hold
        self.strangers = 0  # streams waiting for a group we do not hold
        self._strangers_at: Counter[str] = Counter()  # of which, by remote host
        # rounds that ended here: a late stream for one is refused at once, so its sender
        # stops waiting for us instead of waiting stream_wait (insertion-ordered, bounded)
        self._finished: dict[bytes, None] = {}
        self.server: asyncio.Server | None = None
        # who takes a connection that opens with a RELAY frame (moshpitd/nat/); None: refused
        self.relay: Callable[[Channel, int, bytes], None] | None = None
        self.offers: Offers | None = None  # connections owners behind NAT opened to us
        self.pool: SessionPool[Channel] = SessionPool()  # sessions we opened, idle
        self.idle: OrderedDict[Resume, asyncio.TimerHandle] = OrderedDict()  # we accepted
        self.idle_seconds = ACCEPTED_IDLE_SECONDS
        # streams by side (opened, accepted) and how (handshake: a new connection; session:
        # on a kept one, no connect and no handshake)
        self.streams: Counter[tuple[str, str]] = Counter()

    def accept(self) -> Channel:
        """The protocol of a connection to our data port (a relay's tunnel hands us some)."""
        if len(self.unopened) >= MAX_UNOPENED:  # idle connections: drop the oldest
            next(iter(self.unopened)).drop("too many connections without a HELLO")
            if len(self.unopened) >= MAX_UNOPENED:  # (not yet connected: cannot drop)
                return _Refused(None, 0)
        hello = _Hello(self)
        channel = Channel(hello, self.max_payload, self.congestion)
        hello.channel = channel
        return channel

    async def start(self, host: str, port: int) -> int:
        self.server = await serve(host, port, self.accept)
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        self.pool.close()
        for resume in list(self.idle):
            resume.expire()
        for entries in list(self._waiting.values()):
            for entry in list(entries):
                self.forget(entry)

    async def connect(self, endpoint: str, sink: FrameSink, peer_id: bytes = b"") -> Channel:
        offered = self.offers.take(endpoint, peer_id) if self.offers is not None else None
        if offered is not None:  # the owner, behind NAT, dialed us (moshpitd/nat/reverse.py)
            offered.sink = sink
            self.streams["opened", "reversed"] += 1
            return offered
        host, port = split_endpoint(endpoint)
        self.streams["opened", "handshake"] += 1
        return await connect(host, port, sink, self.max_payload, congestion=self.congestion)

    # --- sessions (transport/session.py's Sessions) ------------------------------------
    def take(self, endpoint: str, peer_id: bytes) -> Channel | None:
        if self.offers is not None and self.offers.has(endpoint, peer_id):
            return None  # a direct path beats a session through a relay: connect() takes it
        channel = self.pool.take(endpoint, peer_id)
        if channel is not None:
            self.streams["opened", "session"] += 1
        return channel

    def keep(self, endpoint: str, channel: Channel) -> None:
        self.pool.keep(endpoint, channel)

    def release(self, channel: Channel) -> None:
        if channel.session is None or not channel.is_open():
            channel.close()
            return
        peer = channel.session.peer_id
        channel.cipher = channel.session.control
        channel.sink = Resume(self, channel)
        same = [r for r in self.idle if r.channel.session is not None
                and r.channel.session.peer_id == peer]
        if len(same) > MAX_PER_PEER:  # a member that opens a connection per round
            evict(same)
        while len(self.idle) > MAX_IDLE:
            evict(list(self.idle))

    def register(self, rnd: ButterflyRound) -> None:
        """A round of ours: its streams are admitted from now on, and those already waiting
        for it go to it now, in the order they came."""
        gid = rnd.group.group_id
        self._rounds[gid] = rnd
        for entry in self._waiting.pop(gid, []):
            self._unwait(entry)
            self._admit(rnd, entry.channel, entry.hello, entry.sender, entry.receiver,
                        entry.since)

    def unregister(self, group_id: bytes) -> None:
        self._rounds.pop(group_id, None)
        self._finished[group_id] = None
        while len(self._finished) > MAX_FINISHED:
            del self._finished[next(iter(self._finished))]

    def route(self, channel: Channel, hello: Hello | Attach, sender: int, receiver: int,
              sink: _Hello | Resume | None = None) -> None:
        """A stream whose HELLO (or ATTACH) checked out in form: to its round, or to wait for
        it."""
        now = timebase.monotonic()
        gid = hello.route
        rnd = self._rounds.get(gid)
        if rnd is not None:
            self._admit(rnd, channel, hello, sender, receiver, now)
        elif gid in self._finished:
            self._refuse(channel, REFUSED_GROUP, sender, now,
                         f"group {gid.hex()[:8]}'s round is over here")
        elif (self.strangers >= self.max_strangers
              or self._strangers_at[host := _host(channel)] >= self.max_strangers // 2):
            self._refuse(channel, REFUSED_BUSY, sender, now,
                         f"busy: {self.strangers} streams already wait for groups unknown "
                         "here; open the stream again")
        else:
            entry = _Waiting(channel, hello, sender, receiver, now, sink, address=host)
            self._strangers_at[entry.address] += 1
            entry.timer = asyncio.get_running_loop().call_later(self.stream_wait,
                                                                 self._expire, entry)
            self._waiting.setdefault(gid, []).append(entry)
            self.strangers += 1
            if sink is not None:
                sink.waiting = entry

    def forget(self, entry: _Waiting) -> None:
        """A waiting stream closed: it waits no more."""
        waiting = self._waiting.get(entry.hello.route)
        if waiting is not None and entry in waiting:
            waiting.remove(entry)
            if not waiting:
                del self._waiting[entry.hello.route]
            self._unwait(entry)

    def _expire(self, entry: _Waiting) -> None:
        self.forget(entry)
        self._refuse(entry.channel, REFUSED_GROUP, entry.sender, entry.since,
                     f"no group {entry.hello.route.hex()[:8]} here after "
                     f"{self.stream_wait:.0f} s")

    def _unwait(self, entry: _Waiting) -> None:
        self.strangers -= 1
        self._strangers_at[entry.address] -= 1
        if self._strangers_at[entry.address] <= 0:
            del self._strangers_at[entry.address]
        if entry.timer is not None:
            entry.timer.cancel()
        if entry.sink is not None:
            entry.sink.waiting = None

    def _admit(self, rnd: ButterflyRound, channel: Channel, hello: Hello | Attach, sender: int,
               receiver: int, since: float) -> None:
        """Attach a stream to our round if its handshake (or its session) proves it is member
        `sender`'s."""
        try:
            if receiver != rnd.me:
                raise DataPlaneError(f"stream meant for member {receiver}, this is {rnd.me}")
            rnd.reducer.check_sender(sender)
        except DataPlaneError as exc:
            self._refuse(channel, REFUSED_GROUP, sender, since, str(exc))
            return
        if isinstance(hello, Attach):
            self._resume(rnd, channel, hello, sender, since)
            return
        try:
            ready, cipher, session = self.handshake.accept(
                hello, rnd.group.digest, rnd.group.members[sender].peer_id, sender, rnd.me)
        except HandshakeError as exc:
            self._refuse(channel, REFUSED_IDENTITY, sender, since, f"refused: {exc}")
            return
        channel.sink = rnd.accept(sender, channel)
        self.streams["accepted", "handshake"] += 1
        channel.send_nowait(READY, rnd.me, ready)  # the last frame in the clear
        channel.cipher, channel.session = cipher, session
        if channel.transport is not None and not channel.transport.is_closing():
            channel.transport.resume_reading()

    def _resume(self, rnd: ButterflyRound, channel: Channel, attach: Attach, sender: int,
                since: float) -> None:
        """A stream on a kept session: its peer proved its key when the session opened."""
        session = channel.session
        if session is None or session.peer_id != rnd.group.members[sender].peer_id:
            self._refuse(channel, REFUSED_IDENTITY, sender, since,
                         f"refused: the session's peer is not member {sender}")
            return
        if attach.digest != rnd.group.digest:
            self._refuse(channel, REFUSED_IDENTITY, sender, since,
                         "refused: another view of the group")
            return
        channel.sink = rnd.accept(sender, channel)
        channel.reset_stats()
        channel.send_nowait(READY, rnd.me)  # sealed with the session's control keys
        channel.cipher = session.next_stream(stream_context(attach.digest, sender, rnd.me))
        self.streams["accepted", "session"] += 1
        if channel.transport is not None and not channel.transport.is_closing():
            channel.transport.resume_reading()

    def _refuse(self, channel: Channel, reason: str, sender: int, since: float,
                why: str) -> None:
        self.refused[reason] += 1
        if reason == REFUSED_GROUP:
            log.info("refusing stream from member %d: %s (waited %.2fs)", sender, why,
                     timebase.monotonic() - since)
        else:  # counted, not logged above DEBUG: any key holder can send these
            log.debug("refusing stream as member %d: %s", sender, why)
        channel.abort(why, code=BUSY if reason == REFUSED_BUSY else 0)


def _host(channel: Channel) -> str:
    peer = channel.transport.get_extra_info("peername") if channel.transport else None
    return str(peer[0]) if isinstance(peer, tuple) else ""
