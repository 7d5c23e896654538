"""What the DHT does for peers behind NAT: client requests, and the requests of moshpitd/nat/.

A daemon that found itself private (moshpitd/nat/reach.py) still queries and stores, but must
not become anyone's contact: others would route to the address its NAT gave it, a mapping the
NAT forgets within a minute or two of silence. Its requests go out marked: the first byte of an
rpcudp request is 0x00, a client's is 0x02. A request so marked is answered as any other, and
its sender is never added to the routing table (`from_client` is set while it is handled).

The NAT requests:
  reach(nodeid, nonce, dht_port, grpc_port, data_port, cookie) -> [ip, port, status], the
      address we saw it at and: a cookie (bytes) to send back for its address, or, given that
      cookie, whether we dial that ip back on those ports (moshpitd/nat/reach.py, DialBack;
      False: too busy);
  reached(nonce): a dial-back datagram, sent from a port the checked peer never talked to;
  relay(nodeid) -> [our data port, reservations we hold] if we take reservations now, else
      None.
"""

from __future__ import annotations

import contextvars
from typing import Any, Protocol

from moshpitd.auth import SwarmKey

REQUEST, REPLY, CLIENT_REQUEST = b"\x00", b"\x01", b"\x02"
from_client: contextvars.ContextVar[bool] = contextvars.ContextVar("from_client", default=False)


class NatHandlers(Protocol):
    def dial_back(self, sender: tuple[str, int], nonce: bytes, ports: tuple[int, int, int],
                  cookie: bytes) -> bool | bytes: ...
    def reached(self, nonce: bytes, kind: str) -> None: ...
    def relay_offer(self) -> list[int] | None: ...


class Outgoing:
    """Our datagrams on their way out: a client's requests marked, every one sealed with the
    swarm key when there is one."""

    def __init__(self, inner: Any, auth: SwarmKey | None, client: Any) -> None:
        self.inner, self.auth, self.client = inner, auth, client

    def sendto(self, data: bytes, addr: tuple[str, int]) -> None:
        self.send(data, addr)
        if data[:1] == REQUEST:  # (rpcudp's requests, and ours, all leave through here)
            self.client.resender.sent(data, addr)

    def send(self, data: bytes, addr: tuple[str, int]) -> None:
        """Marked and sealed, but not tracked: a copy sent again comes through here."""
        if self.client.client and data[:1] == REQUEST:
            data = CLIENT_REQUEST + data[1:]
        if self.auth is not None:
            data = self.auth.seal(b"dht", b"dht", data)
        self.inner.sendto(data, addr)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _port(value: object) -> int:
    if not (isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536):
        raise ValueError("malformed port")
    return value


class NatRPCs:
    """The NAT requests, mixed into the DHT protocol; `nat` is set by the node."""

    nat: NatHandlers | None = None
    client = False  # we are a client: mark our requests

    def rpc_reach(self, sender: tuple[str, int], nodeid: bytes, nonce: bytes, dht: int,
                  grpc: int, data: int, cookie: bytes = b"") -> list[Any]:
        if not (isinstance(nonce, bytes) and len(nonce) == 16 and isinstance(cookie, bytes)
                and self.nat is not None):
            raise ValueError("malformed reach")
        status = self.nat.dial_back(sender, nonce, (_port(dht), _port(grpc), _port(data)),
                                    cookie)
        return [sender[0], sender[1], status]

    def rpc_reached(self, sender: tuple[str, int], nonce: bytes) -> bool:
        if not isinstance(nonce, bytes) or self.nat is None:
            raise ValueError("malformed reached")
        self.nat.reached(nonce, "dht")
        return True

    def rpc_relay(self, sender: tuple[str, int], nodeid: bytes) -> list[int] | None:
        return None if self.nat is None else self.nat.relay_offer()
