"""The control plane as protocol code sees it: calls whose answers stream back, failures of a
known kind, cancellation.

Matchmaking (Join), liveness probes and state downloads (DownloadState) speak to a
`ControlClient` and read `Answers`; they import nothing of gRPC. transport/grpc_server.py's
`ChannelPool` is the implementation daemons use. Another (a relay that carries calls to a peer
behind a NAT, an in-memory network for a simulated swarm) needs only these two shapes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from moshpitd.proto import moshpit_pb2 as pb

if TYPE_CHECKING:
    from moshpitd.transport.gate import Gate

M = TypeVar("M", covariant=True)

# What went wrong with a call, as the caller can act on it.
UNAVAILABLE = "unavailable"  # the peer could not be reached, or went away
DEADLINE = "deadline"  # the call's timeout ran out
NOT_FOUND = "not_found"  # the peer holds nothing under that name
FAILED_PRECONDITION = "failed_precondition"  # it holds another version of it
EXHAUSTED = "exhausted"  # the peer refused for a limit of its own (too many calls, too fast)
REFUSED = "refused"  # the peer refused who we are (a swarm key or TLS it does not accept)
CANCELLED = "cancelled"
FAILED = "failed"  # anything else (a malformed answer, an error inside the peer)


class ControlError(Exception):
    """A control call failed: `kind` is one of the names above; the message says more."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


@dataclass(frozen=True)
class Caller:
    """Who made a call, as the transport saw it: its end of the connection, in the transport's
    own naming (gRPC's peer string; behind the gate, the gate's connection, which it maps back
    to the remote address), and, over TLS, the certificate it presented (PEM; empty without
    TLS). Its peer id is proven by what it signs, not by this."""

    address: str
    certificate: bytes = b""


# The daemon's side of each call: the answers it streams back. A handler refuses a call by
# raising ControlError, which reaches the caller with its kind.
JoinHandler = Callable[[pb.JoinRequest, Caller], AsyncIterator[pb.JoinResponse]]
StateHandler = Callable[[pb.StateRequest, Caller], AsyncIterator[pb.StateChunk]]


class Answers(Protocol[M]):
    """A call's answers in order. `read` gives the next, or None once the peer ended the call;
    it raises ControlError if the call failed or was cancelled (TimeoutError only from a
    caller's own timeout around it; CancelledError only when the reading task itself is
    cancelled). Iterating gives the same answers until the end. `cancel` ends the call from our
    side; it may be called at any time, more than once."""

    async def read(self) -> M | None: ...

    def __aiter__(self) -> AsyncIterator[M]: ...

    def cancel(self) -> None: ...


class AnswerStream(Generic[M]):
    """What every `Answers` implementation shares: iteration is `read` until the end."""

    async def read(self) -> M | None:
        raise NotImplementedError

    async def _answers(self) -> AsyncIterator[M]:
        while (answer := await self.read()) is not None:
            yield answer

    def __aiter__(self) -> AsyncIterator[M]:
        return self._answers()


class ControlClient(Protocol):
    """The calls a daemon makes to peers, each at `endpoint` (host:port)."""

    def join(self, endpoint: str, request: pb.JoinRequest, timeout: float
             ) -> Answers[pb.JoinResponse]: ...

    def download(self, endpoint: str, request: pb.StateRequest, timeout: float
                 ) -> Answers[pb.StateChunk]: ...


class ControlServer(Protocol):
    """The daemon's side of the control plane: it serves the node's handlers at an address."""

    @property
    def gate(self) -> Gate | None:
        """The TCP gate in front of gRPC (transport/gate.py); None without one."""

    @property
    def refused(self) -> Mapping[str, int]:
        """Calls and connections refused, by the bound that refused them."""

    async def start(self, host: str, port: int) -> int: ...

    async def draining(self) -> None: ...

    async def stop(self, grace: float = 1.0) -> None: ...


class Pool(ControlClient, Protocol):
    async def close(self) -> None: ...


# Builds a node's control plane from its handlers: gRPC (transport/grpc_server.py's `grpc`),
# or an in-memory network's (moshpitd/virtual/control.py).
ControlPlane = Callable[[JoinHandler, StateHandler], tuple[ControlServer, Pool]]


__all__ = ["CANCELLED", "DEADLINE", "EXHAUSTED", "FAILED", "FAILED_PRECONDITION", "NOT_FOUND",
           "REFUSED", "UNAVAILABLE", "AnswerStream", "Answers", "Caller", "ControlClient",
           "ControlError", "ControlPlane", "ControlServer", "JoinHandler", "Pool", "StateHandler"]
