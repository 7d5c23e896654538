"""The owner's side of the check of its span (allreduce/verifier.py has the frames, checks.py
the scheme): it lists the members' commitments before its first result goes out, gathers their
seeds once they hold its results, hands every member the seeds and then every contributor's
signed claim, its own included.

An honest owner waits for what honest members send, never for ever: a member whose results are
all out (its stream drained) has PATIENCE_SHARE of the round's grace to answer, one still
receiving them is waited for up to the round's end. What a member withholds costs only it: a
seed that does not come is left out of the spots (every member insists only on its own), and a
missing claim leaves the span unchecked wherever the withholder's values are in it (docs/
security-identity.md, "Checked reductions").
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import numpy as np

from moshpitd import timebase
from moshpitd.allreduce.checks import (
    SEED_BYTES,
    CheckError,
    commitment,
    locate,
    make_claim,
    pack_indexed,
    read_claim,
    sent_values,
    spots,
    spots_digest,
)
from moshpitd.allreduce.plan import Ledger, RoundPlan
from moshpitd.identity import PeerKey

POLL = 0.005  # s: how often the owner looks again at members it waits for (a granularity)


class OwnerCheck:
    def __init__(self, plan: RoundPlan, key: PeerKey) -> None:
        self.plan = plan
        self.key = key
        self.own: dict[int, np.ndarray] = {}  # part index -> our own values, as we added them
        self.commits: dict[int, bytes] = {}
        self.listed: bytes | None = None  # COMMITS, fixed as our first part became final
        self.seeds: dict[int, bytes] = {}
        self.at: np.ndarray | None = None
        self.at_digest = b""
        self.claims: dict[int, bytes] = {}  # claimant -> its signed claim
        # what each sender's parts carried (sender, part index) -> payload: a claim is checked
        # against it, so a contributor that claims other values than it sent is caught here,
        # and never gets an honest owner accused
        self.kept: dict[tuple[int, int], memoryview] = {}
        self.disputed: set[int] = set()  # claimants whose claim disagrees with what they sent
        self._masks: list[int] = []
        self.seeds_out = asyncio.Event()  # SEEDS may go to every member
        self.claims_out = asyncio.Event()  # the claims (and END) may go
        self._news = asyncio.Event()

    def keep_own(self, ledger: Ledger) -> None:
        """Our own values of our span, before the reducer accumulates in place over them: our
        claim is made of them once the spots are known (a copy, in the round's buffers)."""
        for p in self.plan.my_parts:
            dtype = self.plan.dtypes[p.run]
            own = np.frombuffer(ledger.retain(p.numel * dtype.itemsize), dtype=dtype,
                                count=p.numel)
            pos = 0
            for piece in self.plan.view.views(p):
                own[pos:pos + piece.size] = piece
                pos += piece.size
            self.own[p.index] = own

    def on_commit(self, sender: int, payload: memoryview) -> None:
        if len(payload) != SEED_BYTES:
            raise CheckError(f"a commitment of {len(payload)} bytes")
        if self.listed is None and sender != self.plan.me:
            self.commits[sender] = bytes(payload)

    def keep(self, sender: int, part: int, payload: memoryview) -> None:
        self.kept[sender, part] = payload  # (its own buffer: Ledger.retain)

    def fix_commitments(self, excluded: int) -> bytes:
        """The list, fixed as our first result goes out. Members excluded by then get no
        results and will reveal nothing: they are left out (every listed seed must come)."""
        if self.listed is None:
            self.commits = {i: c for i, c in self.commits.items() if not excluded >> i & 1}
            self.listed = pack_indexed(self.commits)
        return self.listed

    def on_reveal(self, sender: int, payload: memoryview) -> None:
        if len(payload) != SEED_BYTES:  # (packed as 32 bytes: another length would no longer
            raise CheckError(f"a seed of {len(payload)} bytes")  # match its commitment)
        if self.listed is None or sender in self.seeds or self.at is not None:
            return  # late, or twice: the spots are drawn without it
        if self.commits.get(sender) != commitment(bytes(payload)):
            raise CheckError("a seed that does not match its commitment")
        self.seeds[sender] = bytes(payload)
        self._news.set()

    def on_claim(self, sender: int, payload: memoryview) -> None:
        if self.at is None or sender in self.claims or self.claims_out.is_set():
            raise CheckError("a claim before the seeds, after the claims went out, or twice")
        claim = read_claim(payload, self.plan.group.digest, self.plan.me,
                           [m.peer_id for m in self.plan.group.members], self.at_digest,
                           self.at.size)
        if claim.claimant != sender:
            raise CheckError("a claim in another member's name")
        if self._sent_otherwise(sender, claim.values):
            self.disputed.add(sender)
        else:
            self.claims[sender] = claim.raw
        self._news.set()

    def _sent_otherwise(self, sender: int, values: np.ndarray) -> bool:
        """Does the claim disagree, at a spot of a part the sender contributed to, with what
        its stream carried? (Exactly: both are the codec's decoding of the same bytes.)"""
        assert self.at is not None
        parts, codec = self.plan.my_parts, self.plan.codec
        which, offset = locate(parts, self.at)
        for k, (w, o) in enumerate(zip(which.tolist(), offset.tolist(), strict=True)):
            p = parts[w]
            if not self._masks[w] >> sender & 1:
                continue
            payload = self.kept.get((sender, p.index))
            if payload is None:
                return True
            if codec.decode_at(payload, p.numel, self.plan.dtypes[p.run], o) != values[k]:
                return True
        return False

    async def run(self, masks: Callable[[], list[int]], draining: Callable[[int], bool],
                  until: float, patience: float) -> None:
        """Seeds, then claims, each from every member that owes them, or as long as the
        waiting rule allows. `masks()` are our parts' contributors; `draining(i)`: our results
        are still on their way to member i."""
        await self._gather(set(self.commits) - {self.plan.me}, self.seeds.__contains__,
                           draining, until, patience)
        total = sum(p.numel for p in self.plan.my_parts)
        self.at = spots(self.plan.group.digest, self.plan.me, self.seeds, total)
        self.at_digest = spots_digest(self.at)
        me = self.plan.me
        contributors = 0
        self._masks = masks()
        for mask in self._masks:
            contributors |= mask
        if contributors >> me & 1 and self.own:
            values = sent_values(self.plan.my_parts, lambda p: [self.own[p.index]], self.at,
                                 None, self.plan.dtypes)
            self.claims[me] = make_claim(self.key, self.plan.group.digest, me, me,
                                         self.at_digest, values)
        self.seeds_out.set()
        owed = {i for i in range(self.plan.size) if contributors >> i & 1} - {me}
        # its own budget: a member that held up the seeds must not leave no time for claims
        await self._gather(owed, lambda i: i in self.claims or i in self.disputed,
                           lambda i: False, max(until, timebase.monotonic() + patience), patience)
        self.claims_out.set()

    def seeds_payload(self) -> bytes:
        return pack_indexed(self.seeds)

    async def _gather(self, owed: set[int], answered: Callable[[int], bool],
                      draining: Callable[[int], bool], until: float, patience: float) -> None:
        since: dict[int, float] = {}
        while True:
            now = timebase.monotonic()
            waiting = False
            for i in owed:
                if answered(i):
                    continue
                if draining(i):
                    since.pop(i, None)
                    waiting = True
                elif now < since.setdefault(i, now) + patience:
                    waiting = True
            if not waiting or now >= until:
                return
            self._news.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(POLL, max(until - now, 0))):
                    await self._news.wait()
