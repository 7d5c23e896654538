"""The frames of relays and dial-backs: data-plane frames of kind RELAY, whose `aux` names the
step. A connection that opens with one is no averaging stream: the registry hands it to the
relay (moshpitd/nat/relay.py) or, for a dial-back, to the reachability check.

Payloads are msgpack, sealed with the swarm key when there is one (an outsider can neither
reserve nor forge a step), and at most MAX_PAYLOAD bytes. Steps:

  RESERVE   private peer -> relay, on the connection it keeps: its public key, a timestamp and
            its signature over them and the relay's peer id (a reservation is per identity)
  RESERVED  relay -> private peer: a token and the relay's two ports for it (gRPC, data)
  CONNECT   relay -> private peer: connection n came in on the gRPC or data port, from address
  ACCEPT    private peer -> relay, on a new connection: token and n; from then on the relay
            splices the two connections and the frame layer is gone
  PING/PONG both ways on the kept connection, so a dead relay is noticed in seconds
  REFUSE    relay -> private peer: why not (then the relay closes)
  REACH     a dial-back: a nonce the checked peer gave us (moshpitd/nat/reach.py)
  REVERSE   a private peer offers a direct connection to a member (moshpitd/nat/reverse.py)
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack

from moshpitd import timebase
from moshpitd.auth import AuthError, ReplayCache, SwarmKey
from moshpitd.identity import PeerKey, peer_id_of, verify
from moshpitd.transport.dataplane import HEADER, RELAY

RESERVE, RESERVED, CONNECT, ACCEPT, PING, PONG, REFUSE, REACH, REVERSE = range(1, 10)
MAX_PAYLOAD = 1024
SIGNED_WINDOW = 120.0  # s: how old a reservation's signature may be
GRPC, DATA = 0, 1  # the two ports of a reservation


class RelayError(Exception):
    """A relay step that is malformed, unsealed, unsigned or refused."""


def frame(swarm: SwarmKey | None, op: int, body: Any) -> bytes:
    payload = msgpack.packb(body, use_bin_type=True)
    if swarm is not None:
        payload = swarm.seal(b"data", b"relay/%d" % op, payload)
    return HEADER.pack(RELAY, 0, 0, 0, len(payload), op) + payload


def parse(swarm: SwarmKey | None, op: int, payload: bytes,
          replay: ReplayCache | None = None, sender: object = None) -> Any:
    if len(payload) > MAX_PAYLOAD:
        raise RelayError(f"relay step of {len(payload)} bytes, over {MAX_PAYLOAD}")
    if swarm is not None:
        try:
            payload = swarm.open(b"data", b"relay/%d" % op, payload, replay, sender)
        except AuthError as exc:
            raise RelayError(f"relay step not sealed with our swarm key: {exc}") from None
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises many kinds on garbage
        raise RelayError(f"undecodable relay step: {exc!r}") from None


def reservation(key: PeerKey, relay_id: bytes, now: float | None = None) -> list[Any]:
    stamp = timebase.wall() if now is None else now
    return [key.public, stamp, key.sign(_signed(relay_id, stamp))]


def reserver(body: Any, relay_id: bytes, now: float | None = None) -> bytes:
    """The peer id a RESERVE body proves, or RelayError."""
    if not (isinstance(body, list) and len(body) == 3 and isinstance(body[0], bytes)
            and isinstance(body[1], float | int) and isinstance(body[2], bytes)):
        raise RelayError("malformed reservation")
    public, stamp, signature = body
    if abs((timebase.wall() if now is None else now) - float(stamp)) > SIGNED_WINDOW:
        raise RelayError("reservation signed too long ago (or clocks out of sync)")
    if not verify(public, signature, _signed(relay_id, float(stamp))):
        raise RelayError("reservation not signed by the key it names")
    return peer_id_of(public)


def _signed(relay_id: bytes, stamp: float) -> bytes:
    return b"moshpit/relay-reservation\0" + relay_id + repr(float(stamp)).encode()


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One RELAY frame from a plain stream: (step, payload)."""
    kind, _flags, _res, _part, length, op = HEADER.unpack(await reader.readexactly(HEADER.size))
    if kind != RELAY or length > MAX_PAYLOAD:
        raise RelayError(f"expected a relay step, got frame kind {kind} of {length} bytes")
    return op, await reader.readexactly(length)
