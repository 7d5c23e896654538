"""The daemon's gRPC server and a pool of channels to peers."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from moshpitd.proto import moshpit_pb2 as pb
from moshpitd.transport import control
from moshpitd.transport.gate import Gate, GateLimits
from moshpitd.transport.security import Security

log = logging.getLogger(__name__)

SERVICE = "moshpit.Averager"
JOIN = f"/{SERVICE}/Join"
DOWNLOAD_STATE = f"/{SERVICE}/DownloadState"
DEFAULT_MAX_MESSAGE = 64 << 20
# What the server may receive in one message: it is only ever sent a JoinRequest, a
# StateRequest or a health check, each well under 2 KiB even sealed. gRPC refuses a longer
# message from its length prefix, before buffering it, so a stranger cannot make the daemon
# hold megabytes per stream (only the client side, which receives StateChunks, needs
# max_message_bytes).
MAX_REQUEST = 8 << 10
# Partial requests are buffered whole, up to MAX_REQUEST each, on every stream: calls that
# never finish their request held about 4 MiB more a second at 64 streams of 16 KiB, and at 16
# of 8 KiB hold at most 128 KiB per connection (8 MiB per address).
# Concurrent streams one HTTP/2 connection may open (a peer needs a few per round), and RPCs
# the server runs at once over all connections (joins are bounded again, per peer id, after
# their signature is checked: matchmaking/admission.py).
MAX_STREAMS_PER_CONNECTION = 16
MAX_CONCURRENT_RPCS = 2048
# A connection with no call open this long is closed (a pool reconnects on its next call).
IDLE_MS = 300_000
RPCS_PER_ADDRESS = "rpcs_per_address"  # `limit` labels of moshpitd_grpc_refused_total
WRITE_STALLED = "write_stalled"

T = TypeVar("T")
M = TypeVar("M")



def channel_options(max_message: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message),
        ("grpc.max_send_message_length", max_message),
        ("grpc.enable_retries", 0),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.http2.max_pings_without_data", 0),
    ]


@dataclass(frozen=True)
class ServerLimits:
    """What the gRPC server holds for peers that have proven nothing yet (see gate.py)."""

    gate: GateLimits = field(default_factory=GateLimits)
    rpcs_per_address: int = 256  # calls open at once through one remote address
    # s a response may wait for its caller to take it (a JoinResponse is < 2 KiB, a StateChunk
    # 1 MiB): a caller that stops reading (an HTTP/2 window of 0) has its call cancelled, so
    # the handler reaches its `finally` and the call leaves the server's count
    write_timeout: float = 30.0


class AveragerServer:
    """Serves the control plane (Join, DownloadState) with generic handlers, behind a gate
    that bounds connections per address (None: gRPC listens on the address itself)."""

    def __init__(self, join: control.JoinHandler, state: control.StateHandler,
                 max_message: int = DEFAULT_MAX_MESSAGE, security: Security | None = None,
                 limits: ServerLimits | None = ServerLimits(),
                 on_refuse: Callable[[str], None] | None = None) -> None:
        self._join = join
        self._state = state
        self.max_message = max_message
        self.security = security or Security()
        self.limits = limits
        self.on_refuse = on_refuse or (lambda why: None)
        self.refused: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()  # remote address -> calls open
        self.gate: Gate | None = None
        self.server: aio.Server | None = None
        self.health = health.aio.HealthServicer()

    def _refuse(self, why: str) -> None:
        self.refused[why] += 1
        self.on_refuse(why)

    async def start(self, host: str, port: int) -> int:
        options = [*(o for o in channel_options(self.max_message)
                     if o[0] != "grpc.max_receive_message_length"),
                   ("grpc.max_receive_message_length", MAX_REQUEST), ("grpc.so_reuseport", 0),
                   ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
                   ("grpc.max_connection_idle_ms", IDLE_MS)]
        self.server = aio.server(options=options, maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS)
        sec = self.security
        handlers = {
            "Join": grpc.unary_stream_rpc_method_handler(
                self._bounded(_serving(self._join)),
                **sec.server_side(JOIN, pb.JoinRequest, pb.JoinResponse)),
            "DownloadState": grpc.unary_stream_rpc_method_handler(
                self._bounded(_serving(self._state)),
                **sec.server_side(DOWNLOAD_STATE, pb.StateRequest, pb.StateChunk)),
        }
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, handlers),)
        )
        # grpc.health.v1: "" is the whole daemon, SERVICE the averager; both NOT_SERVING while
        # draining, so load balancers and probes stop sending work before the port closes
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        inner = (host, port) if self.limits is None else ("127.0.0.1", 0)
        target = f"[{inner[0]}]:{inner[1]}" if ":" in inner[0] else f"{inner[0]}:{inner[1]}"
        creds = sec.server_credentials()
        bound = (self.server.add_insecure_port(target) if creds is None
                 else self.server.add_secure_port(target, creds))
        if bound == 0:
            raise OSError(f"cannot bind gRPC to {target}")
        await self.server.start()
        if self.limits is not None:
            self.gate = Gate(("127.0.0.1", bound), self.limits.gate, self._refuse)
            try:
                bound = await self.gate.start(host, port)
            except OSError:
                await self.server.stop(None)
                raise
        for name in ("", SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return bound

    def _bounded(self, handler: Callable[[T, aio.ServicerContext], AsyncIterator[Any]]
                 ) -> Callable[[T, aio.ServicerContext], AsyncIterator[Any]]:
        """`handler` with the calls of one remote address bounded, and each response written
        within write_timeout or the call cancelled."""
        limits = self.limits
        if limits is None:
            return handler

        async def bounded(request: T, context: aio.ServicerContext) -> AsyncIterator[Any]:
            peer = context.peer()
            origin = self.gate.origin(peer) if self.gate is not None else None
            address = origin or peer.rpartition(":")[0]  # a connection around the gate: its host
            if self.calls[address] >= limits.rpcs_per_address:
                self._refuse(RPCS_PER_ADDRESS)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"{limits.rpcs_per_address} calls are open from this "
                                    "address (setting grpc_max_calls_per_address)")
            self.calls[address] += 1
            task = asyncio.current_task()
            loop = asyncio.get_running_loop()
            try:
                async for response in handler(request, context):
                    watchdog = loop.call_later(limits.write_timeout, self._stalled, task)
                    try:
                        yield response  # gRPC writes it before it resumes us
                    finally:
                        watchdog.cancel()
            finally:
                self.calls[address] -= 1
                if self.calls[address] <= 0:
                    del self.calls[address]

        return bounded

    def _stalled(self, task: asyncio.Task[Any] | None) -> None:
        self._refuse(WRITE_STALLED)
        if task is not None:
            task.cancel()

    async def draining(self) -> None:
        for name in ("", SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace: float = 1.0) -> None:
        await self.health.enter_graceful_shutdown()
        if self.server is not None:
            await self.server.stop(grace)
        if self.gate is not None:
            await self.gate.close()


class ChannelPool:
    """One channel per peer endpoint, created inside the running loop and reused."""

    def __init__(self, max_message: int = DEFAULT_MAX_MESSAGE,
                 security: Security | None = None) -> None:
        self.max_message = max_message
        self.security = security or Security()
        self._channels: OrderedDict[str, aio.Channel] = OrderedDict()

    def channel(self, endpoint: str) -> aio.Channel:
        ch = self._channels.get(endpoint)
        if ch is not None:
            self._channels.move_to_end(endpoint)  # the least recently used one goes first
        else:
            options = [*channel_options(self.max_message), *self.security.channel_options()]
            creds = self.security.channel_credentials()
            ch = (aio.insecure_channel(endpoint, options=options) if creds is None
                  else aio.secure_channel(endpoint, creds, options=options))
            self._channels[endpoint] = ch
            if len(self._channels) > 512:
                oldest = next(iter(self._channels))
                old = self._channels.pop(oldest)
                _ = old.close()
        return ch

    def join(self, endpoint: str, request: pb.JoinRequest, timeout: float
             ) -> GrpcAnswers[pb.JoinResponse]:
        method = self.channel(endpoint).unary_stream(
            JOIN, **self.security.client_side(JOIN, pb.JoinRequest, pb.JoinResponse))
        return GrpcAnswers(method(request, timeout=timeout))

    def download(self, endpoint: str, request: pb.StateRequest, timeout: float
                 ) -> GrpcAnswers[pb.StateChunk]:
        method = self.channel(endpoint).unary_stream(
            DOWNLOAD_STATE,
            **self.security.client_side(DOWNLOAD_STATE, pb.StateRequest, pb.StateChunk))
        return GrpcAnswers(method(request, timeout=timeout))

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()


def _serving(handler: Callable[[T, control.Caller], AsyncIterator[Any]]
             ) -> Callable[[T, aio.ServicerContext], AsyncIterator[Any]]:
    """A transport-free handler as gRPC calls it: the caller from its context, a ControlError
    as the matching status."""
    async def serve(request: T, context: aio.ServicerContext) -> AsyncIterator[Any]:
        pems = context.auth_context().get("x509_pem_cert") or [b""]
        try:
            async for response in handler(request, control.Caller(context.peer(), pems[0])):
                yield response
        except control.ControlError as exc:
            await context.abort(_STATUS.get(exc.kind, grpc.StatusCode.UNKNOWN), str(exc))
    return serve


_KINDS = {
    grpc.StatusCode.UNAVAILABLE: control.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: control.DEADLINE,
    grpc.StatusCode.NOT_FOUND: control.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION: control.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED: control.EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED: control.REFUSED,
    grpc.StatusCode.PERMISSION_DENIED: control.REFUSED,
    grpc.StatusCode.CANCELLED: control.CANCELLED,
}
_STATUS = {kind: code for code, kind in _KINDS.items() if code != grpc.StatusCode.PERMISSION_DENIED}


class GrpcAnswers(control.AnswerStream[M]):
    """transport/control.py's `Answers` over a grpc.aio unary-stream call: its EOF is None,
    its status a ControlError of the matching kind."""

    def __init__(self, call: Any) -> None:
        self._call = call

    async def read(self) -> M | None:
        try:
            answer = await self._call.read()
        except aio.AioRpcError as exc:
            raise _control_error(exc) from None
        except asyncio.CancelledError:
            # the call was cancelled (by `cancel`, or with its channel), not our task
            task = asyncio.current_task()
            if self._call.cancelled() and (task is None or not task.cancelling()):
                raise control.ControlError(control.CANCELLED, "the call was cancelled"
                                           ) from None
            raise
        return None if answer is aio.EOF else cast(M, answer)

    def cancel(self) -> None:
        self._call.cancel()


def _control_error(exc: aio.AioRpcError) -> control.ControlError:
    code = exc.code()
    return control.ControlError(_KINDS.get(code, control.FAILED),
                                f"{code.name}: {exc.details() or ''}"[:300])


def grpc_plane(max_message: int, security: Security, limits: ServerLimits) -> control.ControlPlane:
    """A daemon's control plane: gRPC behind the gate, and a channel per peer."""
    def build(join: control.JoinHandler, state: control.StateHandler
              ) -> tuple[AveragerServer, ChannelPool]:
        return (AveragerServer(join, state, max_message, security, limits),
                ChannelPool(max_message, security))
    return build
