"""A member's check of one owner's span (allreduce/checks.py has the scheme): its results are
held aside as they arrive, and written to the trainer's buffer only once they agree, at spots
the owner could not know while it sent them, with what the span's contributors say they sent.

On one stream, to the owner and back (the frames are the data plane's CHECK kind, the step in
aux):

    COMMIT  ->   the hash of a fresh seed, before our first part
    COMMITS <-   every commitment the owner held when its first part became final, before its
                 first result: a commitment cannot be added once results are out
    REVEAL  ->   our seed, once we hold all of the owner's results
    SEEDS   <-   the seeds revealed to it; the spots are hashed from them
    CLAIM   ->   our values at the spots, as the wire codec carried them, signed
    CLAIM   <-   each other contributor's claim, relayed (the owner can drop one, not forge it)
    DISPUTE <-   instead of a claim that disagrees with what its claimant sent the owner
    END     <-   nothing more: we decide, and the stream ends (a kept session goes on)

A span passes only if every result agrees with the aggregation of the claims of the members
its mask names. A result that disagrees keeps the whole span at our local values and names the
owner (`lied`); a span whose check could not finish (a claim or a frame missing at the round's
end) keeps it too, naming nobody.
"""

from __future__ import annotations

import os

import numpy as np

from moshpitd.allreduce.checks import (
    SEED_BYTES,
    CheckError,
    Unverifiable,
    Verdict,
    commitment,
    make_claim,
    read_claim,
    sent_values,
    spots,
    spots_digest,
    unpack_indexed,
    verify_span,
)
from moshpitd.allreduce.layout import Part
from moshpitd.allreduce.plan import Ledger, RoundPlan
from moshpitd.identity import PeerKey

# CHECK frames' steps (in aux), both directions
COMMIT, COMMITS, REVEAL, SEEDS, CLAIM, END, DISPUTE = 1, 2, 3, 4, 5, 6, 7


class SpanVerifier:
    """Our check of `owner`'s span, with its results held until it passes."""

    def __init__(self, plan: RoundPlan, owner: int, parts: list[Part], key: PeerKey) -> None:
        self.plan = plan
        self.owner = owner
        self.parts = parts
        self.key = key
        self.seed = os.urandom(SEED_BYTES)
        self.commits: dict[int, bytes] | None = None
        self.values: dict[int, np.ndarray] = {}  # part index -> the result, decoded
        self.masks: dict[int, int] = {}  # part index -> its contributors
        self.at: np.ndarray | None = None
        self.at_digest = b""
        self.claims: dict[int, np.ndarray] = {}
        self.disputed: set[int] = set()  # claimants whose claim the owner says is false
        self.unseeded: set[int] = set()  # listed members whose seeds the spots lack
        self.verdict: Verdict | None = None

    def commit(self) -> bytes:
        return commitment(self.seed)

    def on_commits(self, payload: memoryview) -> None:
        if self.commits is not None or self.masks:
            raise CheckError("commitments after results, or twice")
        commits = unpack_indexed(payload, self.plan.size)
        me = self.plan.me
        if self.owner in commits:  # its own seed would let it choose the spots
            raise CheckError("the owner listed a commitment of its own")
        self.commits = commits
        if me in commits and commits[me] != self.commit():
            raise CheckError("the owner listed another commitment as ours")
        if me not in commits:  # (a listener's may come after the first result)
            raise Unverifiable("our commitment came too late to be listed")

    def hold(self, part: Part, values: np.ndarray | None, mask: int) -> None:
        if self.commits is None:
            raise CheckError("a result before the owner's commitments")
        if values is not None:  # (it lies in a buffer of its own: Ledger.retain)
            self.values[part.index] = values
        self.masks[part.index] = mask

    def reveal(self) -> bytes | None:
        """Our seed, if the owner listed our commitment."""
        assert self.commits is not None
        return self.seed if self.plan.me in self.commits else None

    def on_seeds(self, payload: memoryview) -> bytes | None:
        """The spots, from the revealed seeds; returns our signed claim, if we contribute."""
        if self.commits is None or self.at is not None or len(self.masks) < len(self.parts):
            raise CheckError("seeds before every result, or twice")
        seeds = unpack_indexed(payload, self.plan.size)
        for index, seed in seeds.items():
            if self.commits.get(index) != commitment(seed):
                raise CheckError(f"member {index}'s seed does not match its commitment")
        if self.plan.me in self.commits and self.plan.me not in seeds:
            raise Unverifiable("our seed is not among those the spots were drawn from")
        # a listed seed left out (its member failed, or the owner chose to drop it) counts as
        # that member's claim left out too: the parts its values are in stay unchecked, so
        # the owner gains no choice of spots over the parts it could pass
        self.unseeded = set(self.commits) - set(seeds)
        total = sum(p.numel for p in self.parts)
        self.at = spots(self.plan.group.digest, self.owner, seeds, total)
        self.at_digest = spots_digest(self.at)
        me = self.plan.me
        if not any(mask >> me & 1 for mask in self.masks.values()):
            return None  # nothing of ours is in the span: nobody needs our word
        values = sent_values(self.parts, self.plan.view.views, self.at, self.plan.codec,
                             self.plan.dtypes)
        self.claims[me] = values
        return make_claim(self.key, self.plan.group.digest, self.owner, me, self.at_digest,
                          values)

    def on_claim(self, payload: memoryview) -> None:
        if self.at is None:
            raise CheckError("a claim before the seeds")
        claim = read_claim(payload, self.plan.group.digest, self.owner,
                           [m.peer_id for m in self.plan.group.members], self.at_digest,
                           self.at.size)
        if claim.claimant != self.plan.me:
            self.claims[claim.claimant] = claim.values

    def on_dispute(self, payload: memoryview) -> None:
        """The owner says a claim disagrees with what its claimant sent it. Ours never does:
        then the owner lies. Another's: one of the two lies, and we cannot tell which."""
        if self.at is None or len(payload) != 2:
            raise CheckError("a dispute before the seeds, or malformed")
        claimant = int.from_bytes(payload, "big")
        if claimant == self.plan.me and self.plan.me in self.claims:
            raise CheckError("the owner disputes our claim, which is what we sent")
        self.disputed.add(claimant)

    def decide(self) -> Verdict:
        if self.at is None or len(self.masks) < len(self.parts):
            self.verdict = Verdict(False, "the check did not finish")
            return self.verdict
        # a disputed claim is missing like one that never came: the parts its claimant's
        # values are in stay unchecked (local), the others are checked as usual
        masks = [self.masks[p.index] for p in self.parts]
        claims = {i: v for i, v in self.claims.items() if i not in self.unseeded}
        held = [self.values.get(p.index) for p in self.parts]
        weights = [m.weight for m in self.plan.group.members]
        self.verdict = verify_span(self.plan.aggregation, self.plan.codec, self.parts, masks,
                                   held, self.plan.dtypes, self.at, claims, weights)
        return self.verdict

    def apply(self, ledger: Ledger) -> None:
        """The span passed, or the parts of it whose masks did (`Verdict.passed`): their
        results go to the trainer's buffer."""
        verdict = self.verdict
        if ledger.closed or verdict is None or verdict.lied:
            return
        for p in self.parts:
            mask = self.masks.get(p.index, 0)
            values = self.values.get(p.index)
            if mask and values is not None and (verdict.ok or mask in verdict.passed):
                self.plan.view.write(p, values)
                ledger.apply(p.index, mask)

    @property
    def lied(self) -> bool:
        """The check ran to its end and a result disagreed with the claims."""
        return self.verdict is not None and self.verdict.lied
