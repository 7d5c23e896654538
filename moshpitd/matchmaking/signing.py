"""Who a Join and a GroupInfo come from: signatures by the peer key (moshpitd/identity.py).

A JoinRequest names its sender's peer id. A leader takes it only if it carries the public key
whose hash is that id, and that key's signature over every field of the request, the leader's
own peer id, the time, a fresh nonce and, over TLS, the SHA-256 of the certificate the sender
presented in the TLS handshake. So:

- nobody can put a peer into a group without holding its key (phantom followers);
- a join cannot be replayed to another leader, or to the same one later (the nonce is kept for
  the time window);
- over TLS, a join is taken only on a connection authenticated by the certificate the peer key
  signed: the TLS identity and the peer identity are one party.

The leader signs the group's digest (allreduce/group.py) once per group. A follower takes a
GroupInfo only if the leader it asked signed it and is its first member. Every join is new
(a nonce), so a join's signature is verified once and there is nothing to cache; a GroupInfo
is verified once by each follower.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import msgpack
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from moshpitd import timebase
from moshpitd.allreduce.group import Group
from moshpitd.auth import FUTURE_SKEW, WINDOW, AuthError, ReplayCache, timestamp_error
from moshpitd.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, PeerKey, peer_id_of, verify
from moshpitd.proto import moshpit_pb2 as pb

JOIN_DOMAIN = b"moshpit/join/1\x00"
GROUP_DOMAIN = b"moshpit/group-info/1\x00"
PROBE_DOMAIN = b"moshpit/probe/1\x00"
NONCE_BYTES = 16
_UNSIGNED = frozenset({"signature"})


def cert_digest(pem: bytes) -> bytes:
    """SHA-256 of a PEM certificate's DER encoding (the first one of a chain: the leaf a peer
    presents in its TLS handshake)."""
    return hashlib.sha256(x509.load_pem_x509_certificate(pem).public_bytes(Encoding.DER)).digest()


def join_bytes(request: pb.JoinRequest, leader_id: bytes, tls: bytes) -> bytes:
    """What a join's signature covers: every field of the request but the signature, in field
    order (fields added to the message are covered without a change here)."""
    values: list[Any] = [leader_id, tls]
    for field in sorted(request.DESCRIPTOR.fields, key=lambda f: f.number):
        if field.name not in _UNSIGNED:
            values.append(getattr(request, field.name))
    return JOIN_DOMAIN + msgpack.packb(values, use_bin_type=True)


def is_probe(request: pb.JoinRequest) -> bool:
    """A liveness probe: a nonce and no group key (a join always names its key)."""
    return not request.group_key and len(request.nonce) == NONCE_BYTES


def probe_request() -> pb.JoinRequest:
    return pb.JoinRequest(nonce=os.urandom(NONCE_BYTES))


def proves_peer(response: pb.JoinResponse, nonce: bytes, peer_id: bytes) -> bool:
    """Whether a probe's answer was signed by `peer_id`'s key: the declared peer is alive, not
    merely some daemon at the address it declared."""
    return (peer_id_of(response.public_key) == peer_id
            and verify(response.public_key, response.probe_signature, PROBE_DOMAIN + nonce))


class PeerAuth:
    """Our peer key at work in matchmaking: it signs our joins and the groups we lead, and
    checks the joins we are sent. One per daemon: the nonces it keeps refuse a replayed join
    whichever of our rounds it is sent to."""

    def __init__(self, key: PeerKey, tls_cert: bytes | None = None,
                 window: float = WINDOW) -> None:
        self.key = key
        self.tls_binding = cert_digest(tls_cert) if tls_cert else b""
        self.window = window
        self.replay = ReplayCache(window)
        self.refused = 0  # joins that did not prove their peer id

    def answer_probe(self, request: pb.JoinRequest) -> pb.JoinResponse:
        """Our signature over a prober's nonce (about 0.05 ms; a probe is one per line-mate
        and round)."""
        return pb.JoinResponse(code=pb.NOT_LOOKING, message="alive", public_key=self.key.public,
                               probe_signature=self.key.sign(PROBE_DOMAIN + request.nonce))

    # --- joins ---------------------------------------------------------------------------
    def sign_join(self, request: pb.JoinRequest, leader_id: bytes) -> pb.JoinRequest:
        request.public_key = self.key.public
        request.timestamp_ms = int(timebase.wall() * 1000)
        request.nonce = os.urandom(NONCE_BYTES)
        request.signature = self.key.sign(join_bytes(request, leader_id, self.tls_binding))
        return request

    def check_join(self, request: pb.JoinRequest, tls_binding: bytes = b"") -> str | None:
        """Why a join does not prove that its sender holds its peer id's key, or None.
        `tls_binding`: the digest of the certificate the sender presented (empty without TLS)."""
        why = self._join_refusal(request, tls_binding)
        if why is not None:
            self.refused += 1
        return why

    def proves_sender(self, request: pb.JoinRequest, tls_binding: bytes = b"") -> bool:
        """Whether a join proves its sender holds its peer id's key, its nonce left unspent
        (the join may still be taken, and checked again, after this)."""
        return self._join_refusal(request, tls_binding, spend=False) is None

    def _join_refusal(self, request: pb.JoinRequest, tls_binding: bytes, spend: bool = True
                      ) -> str | None:
        if (len(request.public_key) != PUBLIC_KEY_BYTES or len(request.nonce) != NONCE_BYTES
                or len(request.signature) != SIGNATURE_BYTES):
            return "the request carries no proof of its peer id (public key, nonce, signature)"
        if peer_id_of(request.public_key) != request.peer_id:
            return "its public key is not its peer id's"
        now = timebase.wall()
        if (why := timestamp_error(request.timestamp_ms / 1000.0, now, self.window)) is not None:
            return "its " + why
        if not verify(request.public_key, request.signature,
                      join_bytes(request, self.key.peer_id, tls_binding)):
            return ("its signature does not verify (signed for another leader, altered, or "
                    "sent over TLS with a certificate other than the one its peer key signed)")
        if not spend:
            return None
        try:
            self.replay.check(request.nonce, request.timestamp_ms / 1000.0, now,
                              request.peer_id)
        except AuthError as exc:
            return str(exc)
        return None

    # --- groups --------------------------------------------------------------------------
    def sign_group(self, info: pb.GroupInfo, group: Group) -> pb.GroupInfo:
        info.leader_public_key = self.key.public
        info.signature = self.key.sign(GROUP_DOMAIN + group.digest)
        return info

    @staticmethod
    def check_group(info: pb.GroupInfo, group: Group, leader_id: bytes, attempt: float
                    ) -> str | None:
        """Why a GroupInfo is not the one `leader_id` signed as its leader, with the signed
        joins of its followers from the last `attempt` s, or None."""
        if not group.members or group.members[0].peer_id != leader_id:
            return "its first member is not the leader we asked"
        if peer_id_of(info.leader_public_key) != leader_id:
            return "it is not signed with the key of the leader we asked"
        if not verify(info.leader_public_key, info.signature, GROUP_DOMAIN + group.digest):
            return "the leader's signature does not verify"
        return admissions_fault(info, group, leader_id, attempt)


def admissions_fault(info: pb.GroupInfo, group: Group, leader_id: bytes, attempt: float,
                     now: float | None = None) -> str | None:
    """Why the group lists a follower that did not ask this leader to lead it under this key,
    as it is listed, within an attempt (`attempt` s, plus the clock skew), or None. (A peer's
    declaration, even withdrawn, only says it was looking; its signed join says whom it
    asked.) Costs a verification per member."""
    if len(info.admissions) > len(group.members):
        return "it carries more joins than members"
    joins = {a.join.peer_id: a for a in info.admissions}
    now = timebase.wall() if now is None else now
    for m in group.members[1:]:
        a = joins.get(m.peer_id)
        if a is None:
            return f"member {m.peer_id.hex()[:8]} never asked this leader to lead it"
        j = a.join
        if (j.group_key != group.key or j.endpoint != m.endpoint or j.weight != m.weight
                or j.client_mode != m.client_mode or not m.bandwidth <= j.bandwidth
                or j.data_endpoint != m.data_endpoint):
            return f"member {m.peer_id.hex()[:8]} is not listed as it asked to join (a " \
                "leader may lower a member's rate, nothing else)"
        if not attempt + WINDOW >= now - j.timestamp_ms / 1000.0 >= -FUTURE_SKEW:
            return f"member {m.peer_id.hex()[:8]}'s join is not from this attempt"
        if (peer_id_of(j.public_key) != m.peer_id or len(j.signature) != SIGNATURE_BYTES
                or not verify(j.public_key, j.signature, join_bytes(j, leader_id,
                                                                     a.tls_binding))):
            return f"member {m.peer_id.hex()[:8]}'s join to this leader does not verify"
    return None


def tls_binding_of(pem: bytes) -> bytes:
    """The digest of the certificate a caller presented (PEM; empty without TLS)."""
    try:
        return cert_digest(pem) if pem else b""
    except ValueError:
        return b"\x00"  # a certificate we cannot read binds to nothing a signature covers
