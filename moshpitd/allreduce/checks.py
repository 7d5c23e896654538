"""Checked reductions: what a member needs to check a span's result before it applies it.

A span's owner computes its result alone, and every member used to take it as sent. Now each
member holds the results it receives aside and checks them at random coordinates (*spots*) that
nobody could know while results were still being sent: the spots are hashed from seeds that the
members committed to before the first result and reveal only once they hold all of the owner's
results. Every contributor then says, signed, what it sent at those spots (its values as the
wire codec carried them), and each member recomputes the aggregation there from those claims and
compares it with the result it holds. The round's frames (allreduce/ownerlink.py, owner.py) and
the argument for why this holds against an owner who knows the scheme (docs/security-identity.md,
"Checked reductions") are elsewhere; this module is the pure part: seeds, spots, claims, and
the comparison with its float tolerance.

The tolerance is a bound, never an estimate: an honest owner's result differs from the exact
aggregate of the claims only by its accumulation's rounding, the rounding to the run's dtype and
the wire codec's rounding of the result, each bounded per coordinate from the values at hand
(the claims, and for the block codecs the block of the result that holds the spot). It is then
doubled twice over. An honest owner is never accused; a lie smaller than that bound at every
spot passes, and is no larger than the codec's own rounding.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from moshpitd.allreduce.codecs import Codec
from moshpitd.allreduce.layout import Part
from moshpitd.allreduce.robust import aggregate
from moshpitd.identity import PeerKey, peer_id_of, verify

SPOTS = 128  # coordinates checked per span per round (a protocol constant: every member alike)
SEED_BYTES = 32
COMMIT_DOMAIN = b"moshpit/check-commit/1\x00"
SPOTS_DOMAIN = b"moshpit/check-spots/1\x00"
CLAIM_DOMAIN = b"moshpit/check-claim/1\x00"
INDEXED = struct.Struct(">H32s")
CLAIM_HEAD = struct.Struct(">32s64s")  # public key, signature
CLAIM_BODY = struct.Struct(">32sII32sH")  # digest, owner, claimant, spots digest, count
# The aggregations whose result a member can recompute from a few coordinates of every row:
# centered_clip clips each row by its norm over the whole part, so it cannot (it runs unchecked,
# and says so: docs/security-identity.md).
CHECKABLE = ("mean", "trimmed_mean")


class CheckError(ValueError):
    """A check message that is malformed, unsigned or not for this span: its sender broke the
    protocol (an honest owner never relays what it could not check)."""


class Unverifiable(CheckError):
    """The check cannot be made, and nobody is shown to be at fault: the span keeps local
    values (our commitment or seed came too late to be counted, say)."""


def commitment(seed: bytes) -> bytes:
    return hashlib.sha256(COMMIT_DOMAIN + seed).digest()


def pack_indexed(items: dict[int, bytes]) -> bytes:
    """(member index, 32 bytes) pairs: commitments or seeds."""
    if any(len(v) != SEED_BYTES for v in items.values()):
        raise CheckError("a commitment or seed that is not 32 bytes")
    return b"".join(INDEXED.pack(i, v) for i, v in sorted(items.items()))


def unpack_indexed(payload: bytes | memoryview, members: int) -> dict[int, bytes]:
    if len(payload) % INDEXED.size:
        raise CheckError(f"{len(payload)} bytes are not whole (index, value) pairs")
    out: dict[int, bytes] = {}
    for index, value in INDEXED.iter_unpack(payload):
        if index >= members or index in out:
            raise CheckError(f"member index {index} is out of range or repeated")
        out[index] = value
    return out


def spots(digest: bytes, owner: int, seeds: dict[int, bytes], total: int,
          count: int = SPOTS) -> np.ndarray:
    """The span coordinates checked: SHA-256 in counter mode over the group, the span and the
    revealed seeds (no numpy generator: its algorithms may change between versions, and every
    member must draw the same spots). Sorted, without repeats."""
    if total <= 0:
        return np.zeros(0, dtype=np.int64)
    root = hashlib.sha256(SPOTS_DOMAIN + digest + owner.to_bytes(4, "big")
                          + pack_indexed(seeds)).digest()
    words: list[int] = []
    counter = 0
    while len(words) < count:
        block = hashlib.sha256(root + counter.to_bytes(4, "big")).digest()
        words.extend(struct.unpack(">4Q", block))
        counter += 1
    return np.unique(np.array([w % total for w in words[:count]], dtype=np.int64))


def spots_digest(at: np.ndarray) -> bytes:
    return hashlib.sha256(at.astype(">i8").tobytes()).digest()


def make_claim(key: PeerKey, digest: bytes, owner: int, claimant: int, at_digest: bytes,
               values: np.ndarray) -> bytes:
    """A contributor's signed word on the values it sent at the spots."""
    body = CLAIM_BODY.pack(digest, owner, claimant, at_digest, values.size) \
        + values.astype(">f8").tobytes()
    return CLAIM_HEAD.pack(key.public, key.sign(CLAIM_DOMAIN + body)) + body


@dataclass(frozen=True)
class Claim:
    claimant: int
    values: np.ndarray  # float64, one per spot
    raw: bytes  # as signed: what a member relays, and what evidence would quote


def read_claim(payload: bytes | memoryview, digest: bytes, owner: int,
               peer_ids: Sequence[bytes], at_digest: bytes, count: int) -> Claim:
    """A claim relayed by the owner: signed by the claimant's key, for this group, span and
    spots. The owner can drop a claim, not forge or alter one."""
    raw = bytes(payload)
    head = CLAIM_HEAD.size + CLAIM_BODY.size
    if len(raw) != head + 8 * count:
        raise CheckError(f"a claim of {len(raw)} bytes, expected {head + 8 * count}")
    public, signature = CLAIM_HEAD.unpack_from(raw)
    d, o, claimant, at, n = CLAIM_BODY.unpack_from(raw, CLAIM_HEAD.size)
    if d != digest or o != owner or at != at_digest or n != count:
        raise CheckError("a claim for another group, span or set of spots")
    if claimant >= len(peer_ids) or peer_id_of(public) != peer_ids[claimant]:
        raise CheckError(f"a claim whose key is not member {claimant}'s")
    if not verify(public, signature, CLAIM_DOMAIN + raw[CLAIM_HEAD.size:]):
        raise CheckError(f"member {claimant}'s claim does not verify")
    values = np.frombuffer(raw, dtype=">f8", offset=head).astype(np.float64)
    if not np.isfinite(values).all():
        raise CheckError(f"member {claimant} claims values that are not finite")
    return Claim(claimant, values, raw)


def locate(parts: Sequence[Part], at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Span coordinates -> (index into `parts`, offset in that part)."""
    ends = np.cumsum([p.numel for p in parts])
    which = np.searchsorted(ends, at, side="right")
    starts = ends - np.array([p.numel for p in parts])
    return which, at - starts[which]


def elements(pieces: Sequence[np.ndarray], lo: int, hi: int) -> np.ndarray:
    """Elements [lo, hi) of a part that lies in `pieces` (one after another)."""
    out, pos = [], 0
    for piece in pieces:
        a, b = max(lo - pos, 0), min(hi - pos, piece.size)
        if a < b:
            out.append(piece[a:b])
        pos += piece.size
    return np.concatenate(out) if len(out) != 1 else out[0]


def sent_values(parts: Sequence[Part], pieces_of: Callable[[Part], Sequence[np.ndarray]],
                at: np.ndarray, codec: Codec | None, dtypes: dict[int, np.dtype]) -> np.ndarray:
    """Our values at the spots as the owner decoded them: through `codec` (None: the owner's
    own values, which never travel), from the values in their own dtype (a float64 value goes
    to fp16 in one rounding, not through float32), one block per spot for the block codecs (a
    part's blocks start at its first element, so a block encodes alone as it did within the
    part)."""
    which, offset = locate(parts, at)
    out = np.empty(at.size, dtype=np.float64)
    block = 1 if codec is None else codec.block
    lossy = codec is not None and codec.name != "none"
    for k, (w, o) in enumerate(zip(which.tolist(), offset.tolist(), strict=True)):
        p = parts[w]
        lo = o - o % block
        values = elements(pieces_of(p), lo, min(lo + block, p.numel))
        if lossy and codec is not None:
            values = codec.decode(codec.encode(np.ascontiguousarray(values)), values.size,
                                  dtypes[p.run])
        out[k] = float(values[o - lo])
    return out


@dataclass(frozen=True)
class Verdict:
    ok: bool
    why: str = ""
    lied: bool = False  # a result disagreed with the claims (else: the check could not run)
    # the contributor masks whose parts passed, when not all could be checked (a member whose
    # claim never came, say: the parts its values are in stay unchecked, the others pass)
    passed: frozenset[int] = frozenset()


_CODEC_EPS = {"none": 0.0, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
_CODEC_FLOOR = {"fp16": 2.0 ** -24, "bf16": 1e-37}  # absolute rounding of the smallest values
_LEVELS = {"int8": 127, "int4": 7}


def verify_span(aggregation: str, codec: Codec, parts: Sequence[Part], masks: Sequence[int],
                held: Sequence[np.ndarray | None], dtypes: dict[int, np.dtype], at: np.ndarray,
                claims: dict[int, np.ndarray], weights: Sequence[float]) -> Verdict:
    """Does every held result agree, at the spots that fall in it, with the aggregation of the
    claims of the members its mask names? `held[i]` is part i's decoded result (None where its
    mask is 0). Spots are taken together by mask and dtype: one aggregation for each."""
    which, offset = locate(parts, at)
    groups: dict[tuple[int, np.dtype], list[int]] = {}
    for k, w in enumerate(which.tolist()):
        if masks[w]:
            groups.setdefault((masks[w], dtypes[parts[w].run]), []).append(k)
    block = codec.block if codec.name in _LEVELS else 0
    unchecked: set[int] = set()
    for (mask, dtype), ks in groups.items():
        rows = [i for i in range(len(weights)) if mask >> i & 1]
        missing = [i for i in rows if i not in claims]
        if missing:
            unchecked.add(mask)
            continue
        cols = np.array(ks)
        x = np.stack([claims[i][cols] for i in rows])
        wt = np.array([weights[i] for i in rows], dtype=np.float64)
        if not wt.sum() > 0:  # an honest owner's masks name a weighted member
            return Verdict(False, f"a result whose mask names only members of weight 0: "
                                  f"{rows}", lied=True)
        # the reducer's mean weighs by the group's weights as they are; robust aggregations
        # cap them at their median first (robust.aggregate), as the reducer's do
        want = wt @ x / wt.sum() if aggregation == "mean" else aggregate(aggregation, x.copy(),
                                                                          wt)
        values = [held[which[k]] for k in ks]
        got = np.array([float(v[offset[k]]) for v, k in zip(values, ks, strict=True)])
        top = None
        if block:  # the largest value of the result's block around each spot
            starts = [int(offset[k]) - int(offset[k]) % block for k in ks]
            top = np.array([float(np.abs(v[s:s + block]).max())
                            for v, s in zip(values, starts, strict=True)])
        tol = _tolerance(aggregation, codec, dtype, x, wt, want, top)
        bad = np.flatnonzero(~(np.abs(got - want) <= tol))
        if bad.size:
            b = int(bad[0])
            p = parts[which[ks[b]]]
            return Verdict(False, f"part {p.index} element {int(offset[ks[b]])}: "
                                  f"result {got[b]!r}, the claims give {want[b]!r} "
                                  f"(tolerance {tol[b]:.3g})", lied=True)
    checked = {mask for mask, _ in groups}
    if unchecked or set(masks) - {0} - checked:  # (masks that no spot fell in: unchecked)
        missing_from = sorted({i for m in unchecked for i in range(len(weights))
                               if m >> i & 1 and i not in claims})
        return Verdict(False, f"parts unchecked: no claim came from members {missing_from}"
                       if missing_from else "parts unchecked: no spot fell in them",
                       passed=frozenset(checked - unchecked))
    return Verdict(True)


def _tolerance(aggregation: str, codec: Codec, dtype: np.dtype, x: np.ndarray, w: np.ndarray,
               want: np.ndarray, top: np.ndarray | None) -> np.ndarray:
    """Four times the most an honest owner's result can differ from the exact aggregate:
    its sum's rounding (float32 for mean over float16/32 runs, float64 otherwise), the
    rounding to the run's dtype, then the wire codec's (for int8/int4 half a level of the
    result's block: `top`, its largest value, over the levels is the scale an honest encoder
    used)."""
    m = x.shape[0]
    if aggregation == "mean":
        unit = 2.0 ** -53 if dtype == np.float64 else 2.0 ** -24
        accum = (m + 4) * unit * (np.abs(w) @ np.abs(x)) / w.sum()
    else:
        accum = (m + 8) * 2.0 ** -52 * np.abs(x).max(axis=0)
    near = np.abs(want) + accum
    rounding = float(np.finfo(dtype).eps) / 2 if dtype.kind == "f" else 2.0 ** -24
    # the smallest values round by a step, not a share: the run's subnormals, and float32's
    # where a mean of float16 runs accumulates
    floor = float(np.finfo(dtype).smallest_subnormal) if dtype.kind == "f" else 0.0
    floor += float(np.finfo(np.float32).smallest_subnormal)
    tol = accum + rounding * near + _CODEC_EPS.get(codec.name, 0.0) * near \
        + _CODEC_FLOOR.get(codec.name, 0.0) + (m + 4) * floor
    if top is not None:
        tol = tol + top / (2 * _LEVELS[codec.name]) * (1 + 2.0 ** -20)
    return 4 * tol + np.finfo(np.float64).tiny
