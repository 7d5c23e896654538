"""What both sides of one butterfly round share: the plan every member computes alike, and the
ledger of what the round has done to the trainer's buffer.

The sender side (sender.py) and the reducer side (owner.py) each own their state; the only
things they share are these, and the ledger is written through its methods.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import replace

import numpy as np

from moshpitd.allreduce.checks import CHECKABLE
from moshpitd.allreduce.codecs import Codec
from moshpitd.allreduce.group import Group
from moshpitd.allreduce.layout import FlatView, LayoutError, Part, plan_parts
from moshpitd.allreduce.reducer import ArrayPool
from moshpitd.transport.dataplane import FRAME_SLACK

log = logging.getLogger("moshpitd.allreduce.butterfly")

# Receive buffers, reused across rounds: a fresh 1 MiB bytearray per link per round is zeroed
# by the kernel page by page before the first frame lands in it.
STAGING = ArrayPool(32 << 20)
# A checked round keeps every part it receives (results held until their span passes, parts
# kept to check claims against) in buffers of their own: received in place there, never
# copied. Reused across rounds like STAGING, as much as the last checked round used (at least
# RETAINED_FLOOR): fresh buffers cost a page fault per 4 KiB, and with a fixed 256 MiB cap a
# round of 4 x 32M float32 (224 MB kept per daemon) missed the pool and cost 83 % more CPU
# than unchecked, against 25 % with the pool large enough.
RETAINED_FLOOR = 64 << 20
RETAINED = ArrayPool(RETAINED_FLOOR, best_fit=True)

# A part is the unit a reducer waits for before it can send that part's result, so a round's
# pipeline fills in the time one part takes over the slowest member's link, which its other
# connections share. Parts are cut so that this takes at most PART_SECONDS at the group's
# slowest declared rate: 1 MiB over a connection with a third of 20 Mbit/s takes 1.3 s, and
# the slow members' downlinks idled that long in every round. MIN_PART_BYTES bounds the frames
# a tiny declared rate can cost.
PART_SECONDS = 0.05
MIN_PART_BYTES = 64 << 10


def paced_part_bytes(group: Group, requested: int) -> int:
    """The round's part size: the request's, smaller where the slowest member's link would take
    longer than PART_SECONDS per part. Every member computes it alike from the group."""
    rates = [m.bandwidth for m in group.members if math.isfinite(m.bandwidth) and m.bandwidth > 0]
    if len(group.members) < 2 or not rates:
        return requested
    fit = int(min(rates) * 1e6 / 8 * PART_SECONDS / (len(group.members) - 1))
    return min(requested, max(fit, MIN_PART_BYTES))


def unit_weights(group: Group) -> Group:
    """The group with every weight divided by the largest, as reducers weigh contributions:
    each value then enters a weighted sum at most once, so no member's weight, however large,
    pushes the sum past the dtype's range (a weight of 1e308 used to overflow it to Inf, and
    the reducer's own trainer was told its values were not finite). The mean is the same;
    equal weights become 1.0, which a reducer adds without a multiply."""
    top = max((m.weight for m in group.members), default=0.0)
    if top == 1.0 or not (top > 0 and math.isfinite(top)):
        return group
    return replace(group, members=tuple(replace(m, weight=m.weight / top)
                                        for m in group.members))


class RoundPlan:
    """The group (its weights scaled by unit_weights), our place in it, the trainer's buffer
    and its parts: fixed for the round."""

    def __init__(self, group: Group, me: int, view: FlatView, codec: Codec,
                 part_bytes: int, aggregation: str = "mean", checked: bool = False) -> None:
        self.group = unit_weights(group)
        self.aggregation = aggregation
        # every member checks each span's result before applying it (allreduce/checks.py);
        # what the aggregation allows, alike for all: checking is in the schema hash
        self.checking = checked and aggregation in CHECKABLE
        self.me = me
        self.view = view
        self.codec = codec
        self.fp16_range = codec.name == "fp16"  # values beyond it would be sent as Inf
        self.parts = plan_parts(view.runs, group.shares, paced_part_bytes(group, part_bytes), codec)
        self.by_owner: dict[int, list[Part]] = defaultdict(list)
        for p in self.parts:
            self.by_owner[p.owner].append(p)
        self.my_parts = self.by_owner.get(me, [])
        self.dtypes = {i: np.dtype(r.dtype) for i, r in enumerate(view.runs)}
        self.max_part_bytes = max([self.encoded_size(p) for p in self.parts] or [0])

    @property
    def size(self) -> int:
        return len(self.group.members)

    @property
    def listening(self) -> bool:
        """We have weight 0: we send no parts, only receive the results."""
        return bool(self.group.listeners >> self.me & 1)

    def part(self, index: int) -> Part | None:
        return self.parts[index] if 0 <= index < len(self.parts) else None

    def encoded_size(self, p: Part) -> int:
        return self.codec.encoded_size(p.numel, self.dtypes[p.run])

    def link_parts(self) -> list[int]:
        """How many parts we stream to each other owner."""
        if self.listening:
            return []
        return [len(ps) for owner, ps in self.by_owner.items() if owner != self.me]

    def senders(self) -> int:
        """How many members stream parts to us."""
        return self.size - 1 if self.my_parts else 0

    def wire_bytes(self) -> int:
        """Payload bytes this member sends plus receives in a healthy round, in the codec's
        encoding: each other owner's part goes out (unless we listen) and comes back averaged;
        each part of ours comes in from every other weighted member and goes back to every
        other member. The unit the round's deadline is learnt in (moshpitd/clock.py)."""
        mine = sum(self.encoded_size(p) for p in self.my_parts)
        theirs = sum(self.encoded_size(p) for p in self.parts) - mine
        others = self.size - 1
        contributors = others - bin(self.group.listeners & ~(1 << self.me)).count("1")
        return (1 if self.listening else 2) * theirs + (contributors + others) * mine


class Ledger:
    """What the round did to each part of the trainer's buffer (the contributors' bitmask that
    each element averages; 0 where it keeps its local values), and whether our own values were
    refused. Once closed, the trainer owns its buffer again and nothing more is recorded."""

    def __init__(self, plan: RoundPlan) -> None:
        self.plan = plan
        self.applied: dict[int, int] = {}
        self.invalid: LayoutError | None = None
        self.closed = False
        self._staging: list[np.ndarray] = []
        self._retained: list[np.ndarray] = []

    def retain(self, nbytes: int) -> memoryview:
        """A receive buffer of nbytes (and room for the next frame's header) that stays this
        round's until it closes: a checked round's parts and results (RETAINED)."""
        buf = RETAINED.take(nbytes + FRAME_SLACK, np.dtype(np.uint8))
        self._retained.append(buf)
        return buf.data

    def staging(self) -> memoryview:
        """A receive buffer for one part, its tag when sealed and the next frame's header, from
        STAGING; back there when the round closes."""
        buf = STAGING.take(self.plan.max_part_bytes + FRAME_SLACK, np.dtype(np.uint8))
        self._staging.append(buf)
        return buf.data

    def apply(self, index: int, mask: int) -> None:
        if not self.closed:
            self.applied[index] = mask

    def mask(self, index: int) -> int:
        return self.applied.get(index, 0)

    def refuse(self, exc: LayoutError) -> None:
        """Our trainer's values were refused: it hears of it when the round ends."""
        if self.invalid is None and not self.closed:
            self.invalid = LayoutError(f"{exc} (found during the round: parts of the request "
                                       "that were averaged before or beside it hold the "
                                       "group's mean)")
            log.warning("group %s: our trainer's values were refused: %s",
                        self.plan.group.group_id.hex()[:8], exc)

    def check(self, p: Part) -> bool:
        """Are the values of `p` in the trainer's buffer finite (and within fp16's range when
        that codec carries them)? If not, that is refused."""
        try:
            self.plan.view.check_part(p, self.plan.fp16_range)
        except LayoutError as exc:
            self.refuse(exc)
            return False
        return True

    def close(self) -> None:
        self.closed = True
        for buf in self._staging:
            STAGING.give(buf)
        self._staging.clear()
        if self._retained:
            need = sum((b if b.base is None else b.base).nbytes for b in self._retained)
            RETAINED.max_bytes = max(RETAINED_FLOOR, need + need // 4)
        for buf in self._retained:
            RETAINED.give(buf)
        self._retained.clear()
