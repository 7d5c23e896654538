"""Signed subkey records: a record under subkey S is accepted only if S's own key signed it.

A subkey is its writer's peer id, the hash of the writer's public key (moshpitd/identity.py).
A record carries that 32-byte public key and an Ed25519 signature over

    DOMAIN | key | subkey | version (8 bytes) | ttl (float64) | value

where `ttl` is the lifetime the writer gave it and `version` its own wall clock in ns when it
wrote it. Replicas hand a record on as it is, with its original version, ttl and signature, so
nobody else can write, renew or withdraw a peer's records. Versions are checked against the
receiver's clock: one more than CLOCK_SKEW ahead, or one whose signed lifetime ended more than
CLOCK_SKEW ago, is refused, so a record can neither outrank its writer's later ones by a
far-future version nor be replayed once it has expired.

An Ed25519 verification costs about 0.1 ms, and every lookup brings the same records back
from up to k replicas: verified records are remembered (by a digest of all they carry).
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections import Counter, OrderedDict
from dataclasses import dataclass

from moshpitd import timebase
from moshpitd.auth import WINDOW
from moshpitd.identity import (
    PEER_ID_BYTES,
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    PeerKey,
    peer_id_of,
    verify,
)

DOMAIN = b"moshpit/dht-record/1\x00"
CLOCK_SKEW = WINDOW  # s: what peers' clocks may disagree by (as for swarm-key messages)
MAX_TTL = 3600.0  # s: no record lives longer, whatever its writer says
MAX_VERSION = (1 << 63) - 1
CACHE_ENTRIES = 1 << 16

# why a record was refused: the `reason` of moshpitd_dht_records_refused_total
UNSIGNED = "unsigned"  # no or a malformed public key or signature
WRONG_SIGNER = "wrong_signer"  # the key is not the subkey's
BAD_SIGNATURE = "bad_signature"
VERSION = "version"  # outside the receiver's clock window, or a ttl out of bounds


@dataclass(frozen=True, slots=True)
class Proof:
    """What makes a record its writer's: the lifetime it signed, its key and its signature."""

    ttl: float
    public: bytes
    signature: bytes

    def wire(self) -> list[object]:
        return [self.ttl, self.public, self.signature]


def signed_bytes(key: bytes, subkey: bytes, value: bytes, version: int, ttl: float) -> bytes:
    return b"".join((DOMAIN, key, subkey, struct.pack(">qd", version, ttl), value))


def sign(identity: PeerKey, key: bytes, value: bytes, version: int, ttl: float) -> Proof:
    """Our own record under our own peer id."""
    ttl = float(ttl)
    signature = identity.sign(signed_bytes(key, identity.peer_id, value, version, ttl))
    return Proof(ttl, identity.public, signature)


def remaining(version: int, proof: Proof, ttl: float, now: float | None = None) -> float:
    """Seconds a record may still live here: what the sender says is left, never more than
    its signed lifetime allows by our clock (plus the skew peers' clocks may have)."""
    now = timebase.wall() if now is None else now
    return min(ttl, proof.ttl, version / 1e9 + proof.ttl - now + CLOCK_SKEW)


def parse_proof(wire: object) -> Proof | None:
    """A proof as it came off the wire ([signed ttl, public key, signature]), if well-formed."""
    if isinstance(wire, Proof):
        return wire
    if not (isinstance(wire, list | tuple) and len(wire) == 3):
        return None
    signed_ttl, public, signature = wire
    if not (isinstance(public, bytes) and len(public) == PUBLIC_KEY_BYTES
            and isinstance(signature, bytes) and len(signature) == SIGNATURE_BYTES
            and isinstance(signed_ttl, int | float) and not isinstance(signed_ttl, bool)):
        return None
    return Proof(float(signed_ttl), public, signature)


class RecordVerifier:
    """Checks records, remembers those it verified, counts those it refused (by reason)."""

    def __init__(self, cache_entries: int = CACHE_ENTRIES) -> None:
        self.cache_entries = cache_entries
        self._verified: OrderedDict[bytes, None] = OrderedDict()
        self.refused: Counter[str] = Counter()
        self.verifications = 0  # signatures actually checked (cache misses)

    def check(self, key: bytes, subkey: bytes, value: bytes, version: int, ttl: float,
              wire: object, now: float | None = None) -> Proof | None:
        """The record's proof if its writer signed it and its version is plausible by our
        clock, else None (and the refusal counted)."""
        proof = parse_proof(wire)
        reason = UNSIGNED if proof is None else self._refusal(key, subkey, value, version,
                                                              ttl, proof, now)
        if reason is not None:
            self.refused[reason] += 1
            return None
        return proof

    def _refusal(self, key: bytes, subkey: bytes, value: bytes, version: int, ttl: float,
                 proof: Proof, now: float | None) -> str | None:
        if len(subkey) != PEER_ID_BYTES or peer_id_of(proof.public) != subkey:
            return WRONG_SIGNER
        now = timebase.wall() if now is None else now
        if not (0 <= version <= MAX_VERSION and 0.0 <= proof.ttl <= MAX_TTL
                and math.isfinite(ttl) and version / 1e9 <= now + CLOCK_SKEW
                and version / 1e9 + proof.ttl >= now - CLOCK_SKEW):
            return VERSION
        message = signed_bytes(key, subkey, value, version, proof.ttl)
        digest = hashlib.blake2b(message + proof.public + proof.signature,
                                 digest_size=16).digest()
        if digest in self._verified:
            self._verified.move_to_end(digest)
            return None
        self.verifications += 1
        if not verify(proof.public, proof.signature, message):
            return BAD_SIGNATURE
        self._verified[digest] = None
        if len(self._verified) > self.cache_entries:
            self._verified.popitem(last=False)
        return None
