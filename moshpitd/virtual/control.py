"""The control plane on the virtual network: the same calls, messages and errors as gRPC
(transport/control.py), carried in memory. gRPC cannot run on a virtual clock, nor a thousand
servers in one process.

A call's request and each answer are serialised (their size crosses the links, and nothing is
shared between nodes) and travel as a channel already open would carry them: one way per
message, no connection set-up. A host that is gone resets the call (UNAVAILABLE after a round
trip); an address nobody has answers nothing, and the call's deadline ends it. What gRPC's
server adds in front of the handlers (the gate, per-address bounds, the message sealing) is not
simulated: the simulator models honest swarms.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from google.protobuf.message import Message

from moshpitd.proto import moshpit_pb2 as pb
from moshpitd.transport import control
from moshpitd.transport.control import Caller, ControlError
from moshpitd.virtual.net import Host, Network
from moshpitd.virtual.streams import EPSILON

M = TypeVar("M", bound=Message)


class VirtualServer:
    gate = None

    def __init__(self, net: Network, join: control.JoinHandler,
                 state: control.StateHandler) -> None:
        self.net = net
        self.handlers: dict[str, Callable[[Any, Caller], AsyncIterator[Any]]] = {
            "join": join, "download": state}
        self.refused: Counter[str] = Counter()
        self.host: Host | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        self.host = self.net.here()
        self.port = self.host.port(port)
        self.host.control[self.port] = self
        return self.port

    async def draining(self) -> None:
        return None

    async def stop(self, grace: float = 1.0) -> None:
        if self.host is not None and self.host.control.get(self.port) is self:
            del self.host.control[self.port]


class VirtualCall(control.AnswerStream[M]):
    """One call's answers, as the caller reads them (control.Answers)."""

    def __init__(self, net: Network, src: Host, endpoint: str, method: str, request: Message,
                 timeout: float) -> None:
        self.net, self.src, self.method = net, src, method
        loop = net.loop
        self._deadline = loop.time() + timeout
        self._inbox: deque[tuple[float, Any]] = deque()
        self._ready: list[Any] = []
        self._waiter: asyncio.Future[None] | None = None
        self._ended = self._cancelled = False
        self._last = 0.0
        self._task: asyncio.Task[None] | None = None
        ip, _, port = endpoint.rpartition(":")
        self.dst = net.hosts.get(ip.strip("[]"))
        self._port = int(port)
        data = request.SerializeToString()
        if self.dst is not None:
            _, at = net.transmit(src, self.dst, len(data) + 64)
            loop.call_at(at, self._arrived, type(request).FromString(data),
                         context=self.dst.ctx)
        loop.call_at(self._deadline, self._expire, context=src.ctx)

    # --- the server's side ----------------------------------------------------------------
    def _arrived(self, request: Message) -> None:
        dst = self.dst
        assert dst is not None
        server = dst.control.get(self._port)
        if self._cancelled:
            return
        if server is None or not dst.alive:  # its host's kernel resets the connection
            self._post(self.net.transmit(dst, self.src, 64)[1],
                       ControlError(control.UNAVAILABLE, "connection refused"), reset=True)
            return
        self._task = asyncio.ensure_future(self._serve(server.handlers[self.method], request))

    async def _serve(self, handler: Callable[[Any, Caller], AsyncIterator[Any]],
                     request: Message) -> None:
        dst = self.dst
        assert dst is not None
        caller = Caller(f"ipv4:{self.src.ip}:{self.src.port()}")
        try:
            async for answer in handler(request, caller):
                data = answer.SerializeToString()
                self._post(self.net.transmit(dst, self.src, len(data) + 16)[1],
                           type(answer).FromString(data))
            self._post(self.net.transmit(dst, self.src, 16)[1], None)
        except ControlError as exc:
            self._post(self.net.transmit(dst, self.src, 64)[1], exc)
        except Exception as exc:  # gRPC answers a failing handler with UNKNOWN
            self._post(self.net.transmit(dst, self.src, 64)[1],
                       ControlError(control.FAILED, f"the peer failed: {exc!r}"))

    def _post(self, at: float, item: Any, reset: bool = False) -> None:
        if not reset and not (self.dst is not None and self.dst.alive):
            return
        self._last = at = max(at, self._last)
        self._inbox.append((at, item))
        self.net.loop.call_at(at, self._deliver, context=self.src.ctx)

    # --- the caller's side ----------------------------------------------------------------
    def _deliver(self) -> None:
        now = self.net.loop.time() + EPSILON
        while self._inbox and self._inbox[0][0] <= now:
            self._ready.append(self._inbox.popleft()[1])
        self._wake()

    def _expire(self) -> None:
        if not self._ended:
            self._ready.append(ControlError(control.DEADLINE, "deadline exceeded"))
            self._stop_server()
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _stop_server(self) -> None:
        task = self._task
        if task is not None and not task.done() and self.dst is not None:
            delay = self.src.link.delay + self.dst.link.delay
            self.net.loop.call_at(self.net.loop.time() + delay, task.cancel)

    async def read(self) -> M | None:
        while True:
            if self._cancelled:
                raise ControlError(control.CANCELLED, "call cancelled")
            if self._ended:
                return None
            if self._ready:
                item = self._ready.pop(0)
                if item is None:
                    self._ended = True
                    return None
                if isinstance(item, ControlError):
                    self._ended = True
                    raise item
                return item
            self._waiter = self.net.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def cancel(self) -> None:
        if not (self._cancelled or self._ended):
            self._cancelled = True
            self._stop_server()
            self._wake()


class VirtualPool:
    def __init__(self, net: Network) -> None:
        self.net = net
        self.host = net.here()

    def join(self, endpoint: str, request: pb.JoinRequest, timeout: float
             ) -> VirtualCall[pb.JoinResponse]:
        return VirtualCall(self.net, self.host, endpoint, "join", request, timeout)

    def download(self, endpoint: str, request: pb.StateRequest, timeout: float
                 ) -> VirtualCall[pb.StateChunk]:
        return VirtualCall(self.net, self.host, endpoint, "download", request, timeout)

    async def close(self) -> None:
        return None


def virtual_plane(net: Network) -> control.ControlPlane:
    """A node's control plane on `net` (MoshpitNode's `control`), built in its host's context."""
    def build(join: control.JoinHandler, state: control.StateHandler
              ) -> tuple[VirtualServer, VirtualPool]:
        return VirtualServer(net, join, state), VirtualPool(net)
    return build
