"""An idle session we accepted (transport/session.py): it waits for the opener's next stream.

Split from allreduce/registry.py, which routes what such a session's ATTACH names."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any, Protocol

from moshpitd.transport.dataplane import HELLO, Channel, DataPlaneError
from moshpitd.transport.session import ATTACH, Attach


class Routes(Protocol):
    """What an idle session needs of the registry."""

    idle: OrderedDict[Any, asyncio.TimerHandle]
    idle_seconds: float

    def route(self, channel: Channel, hello: Any, sender: int, receiver: int,
              sink: Any = None) -> None: ...

    def forget(self, entry: Any) -> None: ...


class Resume:
    """An idle session we accepted: the next frame is the opener's ATTACH for a new stream."""

    def __init__(self, registry: Routes, channel: Channel) -> None:
        self.registry = registry
        self.channel = channel
        self.waiting: Any = None  # registry._Waiting, while its group is unknown
        registry.idle[self] = asyncio.get_running_loop().call_later(
            registry.idle_seconds, self.expire)

    def expire(self) -> None:
        self._attached()
        self.channel.close()

    def _attached(self) -> None:
        timer = self.registry.idle.pop(self, None)
        if timer is not None:
            timer.cancel()

    def buffer_for(self, kind: int, part: int, length: int, aux: int) -> memoryview | None:
        if kind != HELLO or length != ATTACH.size:
            raise DataPlaneError(f"frame kind {kind} of {length} bytes on an idle session, "
                                 "not an ATTACH")
        return None

    def on_frame(self, kind: int, part: int, payload: memoryview, aux: int) -> None:
        assert self.channel.transport is not None
        self._attached()
        attach = Attach.unpack(payload)
        if (attach.sender, attach.receiver) != (aux, part):
            raise DataPlaneError("the ATTACH's indices differ from its frame's")
        self.channel.transport.pause_reading()  # until it is attached to its round
        self.registry.route(self.channel, attach, aux, part, self)

    def on_close(self, exc: BaseException | None) -> None:
        self._attached()
        if self.waiting is not None:
            self.registry.forget(self.waiting)


def evict(idle: list[Resume]) -> None:
    """Close the oldest of these idle sessions that has nothing left to send (the newest may
    still hold its last stream's final result), else the oldest."""
    victim = next((r for r in idle if r.channel.flushed()), idle[0])
    victim.expire()
