"""An asyncio event loop whose clock is virtual: when nothing is ready it jumps to the next
timer instead of waiting, so a swarm's minutes of protocol run in the seconds its code takes.

Its sockets are a virtual network's (net.py): `create_datagram_endpoint`, `create_connection`
and `create_server` are all the daemon's protocol code uses. Work handed to a thread
(`asyncio.to_thread`) runs inline, so virtual time cannot run ahead of it. A node's CPU time is
not charged to its clock: the simulation measures the protocol on the network it models, not
this machine's cores (the 64-daemon runs were bound by two of them).

Every task records the host whose context created it (net.HOST), so a host that leaves the
swarm takes its tasks with it.
"""

from __future__ import annotations

import asyncio
import contextvars
import selectors
import socket
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Sockets(Protocol):
    """Where the loop opens its sockets (net.Network)."""

    def datagram_endpoint(self, factory: Any, port: int) -> Any: ...

    async def connect(self, factory: Any, ip: str, port: int) -> Any: ...

    def listen(self, factory: Any, port: int) -> Any: ...

# The host whose context this is (net.Host): what a task belongs to, where a socket opens.
HOST: contextvars.ContextVar[Any] = contextvars.ContextVar("virtual_host", default=None)


TICK = 1e-9  # s: one pass of the loop, at least


class Deadlock(RuntimeError):
    """Nothing is ready and no timer is set: whatever the loop waits for can never happen."""


class _Jump(selectors.BaseSelector):
    """What the base loop calls to wait for I/O: it advances the clock by the wait instead."""

    def __init__(self, loop: VirtualLoop) -> None:
        self.loop = loop

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is None:
            raise Deadlock("virtual time stands still: nothing is scheduled")
        # Every pass of the loop takes a little time, as on a real clock: a wait shorter than
        # the clock's float resolution (deadline - now, nearly spent) must still end.
        self.loop.advance(max(timeout, TICK))
        return []

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        raise NotImplementedError("a virtual loop has no file descriptors")

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        raise NotImplementedError("a virtual loop has no file descriptors")

    def get_map(self) -> Any:
        return {}

    def close(self) -> None:
        pass


class VirtualLoop(asyncio.BaseEventLoop):
    def __init__(self, start: float = 0.0) -> None:
        super().__init__()
        self._now = start
        self._selector = _Jump(self)
        self.net: Sockets | None = None  # set by Network(loop)
        self.set_task_factory(_task_factory)  # type: ignore[arg-type]

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds

    def _process_events(self, event_list: list[Any]) -> None:
        pass

    def _write_to_self(self) -> None:
        pass  # nothing runs in another thread

    def run_in_executor(self, executor: Executor | None, func: Callable[..., T],  # type: ignore[override]
                        *args: Any) -> asyncio.Future[T]:
        fut: asyncio.Future[T] = self.create_future()
        try:
            fut.set_result(func(*args))
        except BaseException as exc:  # the awaiting task gets it, as from a thread
            fut.set_exception(exc)
        return fut

    async def getaddrinfo(self, host: Any, port: Any, *, family: int = 0, type: int = 0,
                          proto: int = 0, flags: int = 0) -> list[Any]:
        return [(socket.AF_INET, type or socket.SOCK_STREAM, proto, "", (host, int(port)))]

    def _network(self) -> Sockets:
        if self.net is None:
            raise RuntimeError("this virtual loop has no network")
        return self.net

    async def create_datagram_endpoint(self, protocol_factory: Any, local_addr: Any = None,
                                       remote_addr: Any = None, **kw: Any) -> Any:
        if remote_addr is not None:
            raise NotImplementedError("virtual datagram endpoints are unconnected")
        port = int(local_addr[1]) if local_addr else 0
        return self._network().datagram_endpoint(protocol_factory, port)

    async def create_connection(self, protocol_factory: Any, host: Any = None, port: Any = None,
                                **kw: Any) -> Any:
        return await self._network().connect(protocol_factory, str(host), int(port))

    async def create_server(self, protocol_factory: Any, host: Any = None, port: Any = None,
                            **kw: Any) -> Any:
        return self._network().listen(protocol_factory, int(port or 0))


def _task_factory(loop: VirtualLoop, coro: Any, context: contextvars.Context | None = None
                  ) -> asyncio.Task[Any]:
    task: asyncio.Task[Any] = asyncio.Task(coro, loop=loop, context=context)
    host = HOST.get() if context is None else context.get(HOST)
    if host is not None:
        host.tasks.add(task)
    return task


def run(main: Callable[[], Any], start: float = 0.0) -> Any:
    """Run `main()` (a coroutine function) on a fresh virtual loop to its end."""
    with asyncio.Runner(loop_factory=lambda: VirtualLoop(start)) as runner:
        return runner.run(main())
