"""The sender side of a butterfly round: our parts stream to each owner (allreduce/ownerlink.py
takes its READY and results back), on a kept session when we have one to that peer
(transport/session.py), else on a new connection and handshake."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from moshpitd import timebase
from moshpitd.allreduce.ownerlink import Exclusions, OwnerLink, ReadyGate
from moshpitd.allreduce.plan import Ledger, RoundPlan
from moshpitd.allreduce.verifier import COMMIT
from moshpitd.hooks import Hooks
from moshpitd.transport.dataplane import (
    CHECK,
    HELLO,
    PART,
    Channel,
    DataPlaneError,
    FrameSink,
)
from moshpitd.transport.handshake import Handshake
from moshpitd.transport.session import Attach
from moshpitd.transport.stats import Stats

log = logging.getLogger("moshpitd.allreduce.butterfly")

Connector = Callable[[str, FrameSink, bytes], Awaitable[Channel]]  # endpoint, sink, peer id


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
        self.links = [OwnerLink(plan, ledger, o, ps, self.gate, exclusions, handshake.key)
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

    def _keep(self, link: OwnerLink) -> None:
        """A stream that ended cleanly leaves its connection to the pool, for our next
        stream to that peer (transport/session.py)."""
        channel = link.channel
        if (self.sessions is not None and channel is not None and channel in self.channels
                and link.done.is_set() and link.reusable()
                and channel.flushed()):  # none of our parts still queued
            # (views of the trainer's buffer: an owner that answered before it had them all)
            self.channels.remove(channel)
            link.final = channel.stats()
            self.finished.append(link.final)
            self.sessions.keep(self.plan.group.members[link.owner].data_endpoint, channel)

    async def stop(self) -> None:
        for link in self.links:  # (a task not yet resumed after its last result)
            self._keep(link)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _exchange(self, link: OwnerLink, deadline: float) -> None:
        try:
            async with asyncio.timeout(max(deadline - timebase.monotonic(), 0)):
                channel = await self._open(link)
            if link.check is not None:  # before any part: see allreduce/verifier.py
                await channel.send(CHECK, link.owner, link.check.commit(), aux=COMMIT)
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
                if link.done.is_set():
                    break
                # straight from the trainer's buffer (codec none), piece by piece
                await channel.send(PART, p.index, *codec.encode_pieces(view.views(p)))
            link.sent_at = timebase.monotonic()
            await link.done.wait()
            self._keep(link)
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
                channel = await self.connect(member.data_endpoint, link, member.peer_id)
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
