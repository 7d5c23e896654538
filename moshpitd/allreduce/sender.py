"""The sender side of a butterfly round: our parts stream to each owner, whose averaged results
come back on the same connection.

An owner's results are untrusted like any contribution: each is received into the link's staging
buffer, checked for NaN/Inf, and only then copied into the trainer's buffer; a non-finite one
leaves the part at our local values (mask 0). Receiving straight into the trainer's buffer would
save that copy, but a poisoned result would then have overwritten the very values we must fall
back to, and their only other copy went to that owner. (Setting our values aside as a result's
header arrives, and receiving in place, was measured and is no cheaper: the kernel writes
received bytes past the cache either way, so one part-sized read from memory stays.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from moshpitd.allreduce.layout import Part, all_finite
from moshpitd.allreduce.plan import Ledger, RoundPlan
from moshpitd.hooks import Hooks
from moshpitd.transport.dataplane import (
    ABORT,
    BAD_VALUES,
    BUSY,
    HELLO,
    LEFT,
    PART,
    READY,
    RESULT,
    Channel,
    DataPlaneError,
    FrameSink,
    Stats,
    TamperedFrame,
)
from moshpitd.transport.handshake import Handshake, HandshakeError, Pending
from moshpitd.transport.session import Attach, stream_context

log = logging.getLogger("moshpitd.allreduce.butterfly")

Connector = Callable[[str, FrameSink], Awaitable[Channel]]


class Sessions(Protocol):
    """Where a round's streams leave their connections (allreduce/registry.py, on
    transport/session.py)."""

    def take(self, endpoint: str, peer_id: bytes) -> Channel | None:
        """An idle session we opened to that peer, or None."""

    def keep(self, endpoint: str, channel: Channel) -> None:
        """A stream we opened ended cleanly: keep its connection for our next one."""

    def release(self, channel: Channel) -> None:
        """A stream we accepted ended cleanly: wait on its connection for the peer's next."""
# An owner that has no room for our stream yet (BUSY: it does not know our group, and strangers
# fill its table) hears from us again after BUSY_RETRY, doubling up to BUSY_RETRY_MAX: protocol
# constants, the time for our group to reach it (a GroupInfo on the way), not a round's deadline.
BUSY_RETRY = 0.005  # s
BUSY_RETRY_MAX = 0.1  # s


class Exclusions(Protocol):
    """What the sender side tells the reducer side: an owner is also a sender to us, and when
    its daemon is gone its parts will not come either."""

    def exclude(self, sender: int, why: str, fault: str = "other") -> None: ...

    def lost(self, sender: int, why: str, fault: str) -> None:
        """Exclude `sender` if we still lack any of its parts."""


class ReadyGate:
    """Every owner READY (or failed): one event per round, whatever the group's size.

    A member streams its parts once every owner has the round (it answers our HELLO with
    READY), or the clock's start wait after the round started. Members learn of their group up
    to ~20-30 ms apart on a busy machine: those that stream meanwhile take the CPU the late one
    needs to learn of it, and then it is left alone with its share of the work at the end of
    the round, one core idle."""

    def __init__(self, owners: int, until: float) -> None:
        self.left = owners
        self.until = until
        self.event = asyncio.Event()
        self.opened = time.monotonic()  # when the last owner answered (the phase log's)
        if owners <= 0:
            self.event.set()

    def mark(self) -> None:
        self.left -= 1
        if self.left <= 0 and not self.event.is_set():
            self.opened = time.monotonic()
            self.event.set()

    async def wait(self, deadline: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(min(self.until, deadline) - time.monotonic(), 0)):
                await self.event.wait()


class OwnerLink:
    """Averaged parts coming back from one owner."""

    def __init__(self, plan: RoundPlan, ledger: Ledger, owner: int, parts: list[Part],
                 gate: ReadyGate, exclusions: Exclusions) -> None:
        self.plan = plan
        self.ledger = ledger
        self.owner = owner
        self.parts = parts
        self.waiting = {p.index for p in parts}
        self.done = asyncio.Event()
        self.progress = asyncio.Event()  # set per result: the send window moves
        self.failure: str | None = None
        self.told = False  # it sent ABORT: its stream then closes, and that is no news
        self.staging = ledger.staging()  # results land here to be checked
        self._gate = gate
        self._exclusions = exclusions
        self._ready = False  # READY came (or the owner failed)
        self.channel: Channel | None = None  # the stream of the current attempt
        self.pending: Pending | None = None  # our HELLO, until the owner's READY answers it
        self.handshake: Handshake | None = None
        self.answered = asyncio.Event()  # READY proved the owner, or BUSY, or it failed
        self.busy = False
        self.unready = False  # our HELLO or ATTACH went out, the owner's READY did not come
        self.resumed = False  # the attempt runs on a kept session (ATTACH, not HELLO)
        self.stale = False  # ... and that session was gone before its READY
        self.context = stream_context(plan.group.digest, plan.me, owner)
        self.whole = True  # every result so far counts our part (so the owner kept it all)
        self.sent_at = 0.0  # when our last part went to the transport (the phase log's)

    def opening(self, channel: Channel, handshake: Handshake, pending: Pending | None) -> None:
        """A new attempt at the stream: `pending` is the HELLO we sent on `channel`, or None
        for the ATTACH on a kept session."""
        self.channel, self.handshake, self.pending = channel, handshake, pending
        self.busy = self.stale = False
        self.unready, self.resumed = True, pending is None
        self.answered.clear()

    def reusable(self) -> bool:
        """The stream ended cleanly both ways: every part in at the owner, every result here,
        nothing said against it. Its connection can carry our next stream to this peer."""
        ch = self.channel
        return (ch is not None and ch.is_open() and ch.session is not None and self.whole
                and not self.waiting and self.failure is None and not self.told
                and not self.unready)

    def buffer_for(self, kind: int, part: int, length: int, aux: int) -> memoryview | None:
        if self.unready and kind not in (READY, ABORT):
            raise DataPlaneError(f"owner {self.owner} sent frame kind {kind} before its READY")
        if kind != RESULT:
            return None
        p = self.plan.part(part)
        if p is None or p.owner != self.owner or part not in self.waiting:
            raise DataPlaneError(f"owner {self.owner} returned part {part}, not expected")
        want = self.plan.encoded_size(p) if aux else 0
        if length != want:
            raise DataPlaneError(f"result {part}: {length} bytes, expected {want}")
        return self.staging  # consumed by on_frame before the next frame

    def on_frame(self, kind: int, part: int, payload: memoryview, aux: int) -> None:
        if kind == READY:
            self._proven(payload)
            return
        if kind == ABORT and aux == BUSY and self.unready:
            self.busy = True  # no room for us there yet: the stream opens again
            self.answered.set()
            return
        if kind == ABORT:
            why = bytes(payload).decode(errors="replace")
            self.told = True
            if aux == BAD_VALUES:  # were our values to blame? then our trainer hears of it
                self._recheck(part)
            self.fail(why)
            if aux == LEFT:  # nor will its parts come, if any are still missing
                self._exclusions.lost(self.owner, f"it left the round: {why}", "aborted")
            return
        if kind != RESULT:
            self.fail(f"unexpected frame kind {kind}")
            return
        if self.ledger.closed:  # the round is over: the trainer's buffer is its own again,
            return  # and this part stays reported as what it held at the close
        p = self.plan.parts[part]
        if aux and (aux >> self.plan.size):
            self.fail(f"result {part} names members that do not exist")
            return
        if not (self.plan.listening or aux >> self.plan.me & 1):
            self.whole = False  # the owner lacks our part: it will not keep the stream
        if aux:
            values = self.plan.codec.decode(payload, p.numel, self.plan.dtypes[p.run])
            if all_finite(values):
                self.plan.view.write(p, values)
            else:
                log.warning("owner %d returned NaN or Inf for part %d: it keeps local values",
                            self.owner, part)
                aux = 0
        self.ledger.apply(part, aux)
        self.waiting.discard(part)
        if not self.waiting:
            if self.reusable():  # the owner handed the session on as it sent this: what
                assert self.channel is not None and self.channel.session is not None
                self.channel.cipher = self.channel.session.control  # comes next is sealed so
            self.done.set()
        self.progress.set()

    def _proven(self, ready: memoryview) -> None:
        """The owner's READY: it must prove the owner's key and answer our HELLO; the stream
        is sealed from the next frame on when the daemons encrypt."""
        if not self.unready or self.handshake is None or self.channel is None:
            self.fail("READY that answers no HELLO of ours")
            return
        if self.resumed:  # opened with the session's control keys: the session vouches
            session = self.channel.session
            assert session is not None
            if len(ready):
                self.fail("a kept session's READY carries nothing")
                self.channel.abort("malformed READY")
                return
            self.channel.cipher = session.next_stream(self.context)
        else:
            assert self.pending is not None
            try:
                self.channel.cipher, self.channel.session = self.handshake.finish(
                    self.pending, ready)
            except HandshakeError as exc:
                self.fail(f"it did not prove to be member {self.owner}: {exc}")
                self.channel.abort(f"refused READY: {exc}")
                return
        self.pending, self.unready = None, False
        self.answered.set()
        self._mark_ready()

    def in_flight(self, sent: int) -> int:
        return sent - (len(self.parts) - len(self.waiting))

    def on_close(self, exc: BaseException | None) -> None:
        """Closed without a word: its daemon is gone (or its round is over), so its parts will
        not come either; that holds even when all its results are in and it never connected
        to us as a sender, which would otherwise leave us waiting for the deadline. Closed
        after an ABORT: that said what happened, and is not counted again."""
        if self.failure is not None or self.told or self.busy:
            return
        if self.resumed and self.unready:  # a kept session that died idle (its peer
            self.stale = True              # restarted, or closed it): open a fresh one
            self.answered.set()
            return
        if isinstance(exc, TamperedFrame):  # the path, not necessarily its daemon, is bad
            self.fail(f"its results were tampered with: {exc}")
            return
        if self.waiting:
            self.fail(f"stream closed ({exc or 'EOF'})")
        self._exclusions.lost(self.owner, "its connection dropped", "disconnected")

    def fail(self, why: str) -> None:
        if self.failure is None and self.waiting:
            self.failure = why
            log.info("owner %d failed: %s; its %d remaining parts keep local values",
                     self.owner, why, len(self.waiting))
        self.done.set()
        self.progress.set()
        self.answered.set()
        self._mark_ready()

    def _recheck(self, index: int) -> None:
        """The owner refused our part as data: if our values are to blame, remember it."""
        p = self.plan.part(index)
        if p is not None and p.owner == self.owner and not self.ledger.closed:
            self.ledger.check(p)

    def _mark_ready(self) -> None:
        if not self._ready:
            self._ready = True
            self._gate.mark()


class SenderSide:
    """Our parts to every other owner, and their results back."""

    def __init__(self, plan: RoundPlan, ledger: Ledger, connect: Connector, hooks: Hooks,
                 exclusions: Exclusions, handshake: Handshake,
                 max_in_flight: int, start_wait_until: float,
                 sessions: Sessions | None = None) -> None:
        self.plan = plan
        self.connect = connect
        self.sessions = sessions  # kept connections, and where ours go once clean
        self.hooks = hooks
        self.handshake = handshake  # our peer key: owners take only streams that prove it
        self.max_in_flight = max_in_flight
        self.exclusions = exclusions
        owners = {o: ps for o, ps in plan.by_owner.items() if o != plan.me}
        self.gate = ReadyGate(len(owners), start_wait_until)
        self.links = [OwnerLink(plan, ledger, o, ps, self.gate, exclusions)
                      for o, ps in owners.items()]
        self.channels: list[Channel] = []  # this round's, still ours
        self.finished: list[Stats] = []  # streams whose connections went back to the pool
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, deadline: float) -> None:
        self._tasks = [asyncio.create_task(self._exchange(link, deadline))
                       for link in self.links]

    async def all_answered(self) -> None:
        """Until every owner answered all our parts or failed."""
        await asyncio.gather(*(link.done.wait() for link in self.links))

    def fail_unanswered(self, why: str) -> None:
        for link in self.links:
            link.fail(why)

    def progress(self) -> int:
        return (sum(ch.progress() for ch in self.channels)
                + sum(st.progress() for st in self.finished))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _exchange(self, link: OwnerLink, deadline: float) -> None:
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0)):
                channel = await self._open(link)
            if not self.plan.listening:  # a listener sends nothing, it waits for results
                await self.gate.wait(deadline)  # every owner has the round: see ReadyGate
            codec, view = self.plan.codec, self.plan.view
            for i, p in enumerate([] if self.plan.listening else link.parts):
                while link.in_flight(i) >= self.max_in_flight and not link.done.is_set():
                    link.progress.clear()  # the owner is behind: wait for its next answer
                    await link.progress.wait()
                if link.done.is_set():
                    break  # it failed or excluded us: nothing more to send
                await self.hooks.before_part(i)
                # straight from the trainer's buffer (codec none), piece by piece
                await channel.send(PART, p.index, *codec.encode_pieces(view.views(p)))
            link.sent_at = time.monotonic()
            await link.done.wait()
            if self.sessions is not None and link.reusable():
                self.channels.remove(channel)
                self.finished.append(channel.stats())
                self.sessions.keep(self.plan.group.members[link.owner].data_endpoint, channel)
        except ConnectionRefusedError as exc:
            # nobody listens there: it died, so do not wait for its parts either
            link.fail(f"cannot connect: {exc!r}")
            self.exclusions.exclude(link.owner, "its data plane refuses connections",
                                    "disconnected")
        except (OSError, ValueError, DataPlaneError) as exc:  # ValueError: a bad endpoint
            silent = link.failure is None and not link.told  # it died or broke the protocol
            link.fail(f"cannot stream to it: {exc!r}")
            if silent:
                self.exclusions.exclude(link.owner, f"its stream failed: {exc!r}",
                                        "disconnected")
        except TimeoutError as exc:
            link.fail(f"cannot stream to it: {exc!r}")

    async def _open(self, link: OwnerLink) -> Channel:
        """Our stream to `link`'s owner, its handshake done (or the link failed). An owner
        that has no room for it yet (BUSY) is asked again."""
        group, me = self.plan.group, self.plan.me
        member = group.members[link.owner]
        retry = BUSY_RETRY
        fresh = self.sessions is None
        while True:
            kept = None
            if not fresh and self.sessions is not None:
                kept = self.sessions.take(member.data_endpoint, member.peer_id)
            if kept is not None:  # no connect, no handshake: ATTACH under its control keys
                channel = kept
                self.channels.append(channel)
                channel.sink = link
                channel.reset_stats()
                link.opening(channel, self.handshake, None)
                attach = Attach(group.group_id, group.digest, me, link.owner)
                try:
                    await channel.send(HELLO, link.owner, attach.pack(), aux=me)
                except DataPlaneError:  # it closed as we took it
                    link.stale = True
            else:
                channel = await self.connect(member.data_endpoint, link)
                self.channels.append(channel)
                hello, pending = self.handshake.hello(*group.route_to(link.owner), me,
                                                      link.owner)
                link.opening(channel, self.handshake, pending)
                await channel.send(HELLO, link.owner, hello, aux=me)
            if not link.stale:
                await link.answered.wait()
            if link.stale:  # that session was gone: a new connection, at once
                self.channels.remove(channel)
                fresh = True
                continue
            if not link.busy:
                return channel
            channel.sink = None  # its close is no news to the link
            channel.close()
            await asyncio.sleep(retry)
            retry = min(2 * retry, BUSY_RETRY_MAX)
