"""Fault injection for the fault tests: a daemon told to misbehave in one round.

The daemon's entry point installs a FaultPlan as its hooks (moshpitd/hooks.py) only when
MOSHPITD_FAULT is set; nothing else imports this module. Set MOSHPITD_FAULT=KIND[@ROUND] (ROUND
counts this daemon's all-reduce rounds from 1; default 1) and optionally
MOSHPITD_FAULT_MARKER=PATH, a file written the moment the fault fires, so a test can act (kill
a process) at a known point.

KIND: crash-before-send, crash-mid-send (after one part on a link), stall-send (silent after
one part on every link), slow-send (pauses SLOW_SECONDS once, then goes on), trickle-send
(sleeps TRICKLE_SECONDS before every part: slow but never silent), crash-while-reducing (at a
contribution), stall-reduce, poison-results (a reducer puts an Inf into the first result on
each of its streams), lie-results (a reducer returns 1000.0 for every element of its span,
from round ROUND on: the lying owner of checked reductions), die-mid-serve (a state donor
exits after sending part of a range to a joiner; ROUND is ignored), hang-listener (the whole
daemon hangs, its event loop blocked like a stopped host, as the first round in which it has
weight 0 starts; ROUND is ignored),
tamper-relay (a relay flips a bit in every relayed data-plane chunk once TAMPER_AFTER bytes
went through it, past the streams' handshakes; ROUND is ignored),
tamper-group (a leader alters each group it sends its followers, in turn: TAMPERINGS; ROUND is
ignored; the marker names the latest). The crashes, and stall-send's marker, wait until every
other member's stream reached us (`sender_accepted`): the fault then surely lands mid-round for
everyone.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field, replace

import numpy as np

from moshpitd.allreduce.codecs import Codec
from moshpitd.allreduce.group import Group, GroupMember
from moshpitd.hooks import Hooks

KINDS = {"crash-before-send", "crash-mid-send", "stall-send", "slow-send", "trickle-send",
         "crash-while-reducing", "stall-reduce", "poison-results", "lie-results",
         "die-mid-serve",
         "hang-listener", "tamper-group", "tamper-relay"}
STALL_SECONDS = 3600.0
SLOW_SECONDS = 1.5
TRICKLE_SECONDS = 0.3
TAMPER_AFTER = 64 << 10


# What tamper-group does to the groups it leads, in turn: another codec than the one asked for;
# every follower's rate raised a thousandfold (a leader may lower a declared rate to what it
# measured, never raise one: that would hand a colluder the largest span the share cap allows);
# a member nobody declared; the leader's own weight 1e308 (which overflowed reducers' sums).
TAMPERINGS = ("codec", "bandwidth", "phantom", "weight")


def tampered(group: Group, how: str) -> Group:
    lead, *rest = group.members
    if how == "codec":
        return replace(group, codec="int8" if group.codec != "int8" else "none")
    if how == "bandwidth":
        return replace(group, members=(lead, *(replace(m, bandwidth=1000 * m.bandwidth + 1)
                                               for m in rest)))
    if how == "phantom":
        ghost = GroupMember(os.urandom(20), "127.0.0.1:9", 1.0, data_endpoint="127.0.0.1:9")
        return replace(group, members=(*group.members, ghost))
    return replace(group, members=(replace(lead, weight=1e308), *rest))


def poisoned(codec: Codec, payload: memoryview | bytes, n: int, dtype: np.dtype) -> memoryview:
    """A result's wire bytes with one of its n values turned into Inf (a new buffer)."""
    values = codec.decode(memoryview(payload), n, dtype).copy()
    values[n // 2] = np.inf
    return codec.encode(values)


@dataclass
class FaultPlan(Hooks):
    kind: str = ""
    at_round: int = 1
    marker: str | None = None
    rounds: int = 0
    stalling: int = 0  # links of this round that stall-send will stall (those with 2+ parts)
    stalled: int = 0  # of them, links stalled so far
    senders: int = 0  # members that stream parts to us this round
    accepted: int = 0  # of them, streams that reached us
    reducing: bool = False  # crash-while-reducing: a contribution arrived
    relayed_bytes: int = 0  # tamper-relay: data-plane bytes relayed so far
    engaged: asyncio.Event = field(default_factory=asyncio.Event)
    led: int = 0  # groups led so far (tamper-group)

    @classmethod
    def from_env(cls) -> FaultPlan:
        spec = os.environ.get("MOSHPITD_FAULT", "")
        if not spec:
            return cls()
        kind, _, at = spec.partition("@")
        if kind not in KINDS:
            raise ValueError(f"MOSHPITD_FAULT={spec!r}: unknown fault (one of {sorted(KINDS)})")
        return cls(kind, int(at or 1), os.environ.get("MOSHPITD_FAULT_MARKER"))

    def begin_round(self, link_parts: list[int], senders: int, listening: bool = False) -> None:
        if listening and self.kind == "hang-listener":
            self._fire()
            time.sleep(STALL_SECONDS)  # blocks the whole daemon: nothing of it answers
        self.rounds += 1
        self.stalling = sum(1 for n in link_parts if n > 1)
        self.stalled = self.accepted = 0
        self.senders, self.reducing = senders, False
        self.engaged = asyncio.Event()
        if not senders:
            self.engaged.set()

    def sender_accepted(self) -> None:
        """A member's stream reached us: it has the group. Once all have, every member is in
        the round, and a crash can no longer keep one out (a leader that died before its
        GroupInfo reached everyone would: a matchmaking fault, not the one under test)."""
        self.accepted += 1
        if self.accepted < self.senders:
            return
        self.engaged.set()
        if self._now("crash-before-send") or (self.reducing and self._now(
                "crash-while-reducing")):
            self._crash()  # before the last sender's parts: no part of ours is final
        self._stall_marker()

    def _now(self, kind: str) -> bool:
        return self.kind == kind and self.rounds == self.at_round

    def _fire(self) -> None:
        if self.marker:
            with open(self.marker, "w") as f:
                f.write(self.kind)

    def _crash(self) -> None:
        self._fire()
        os._exit(17)

    def _stall_marker(self) -> None:
        if self._now("stall-send") and self.engaged.is_set() and self.stalled >= self.stalling:
            self._fire()  # every member is in the round and every owner holds our first part

    async def before_part(self, sent: int) -> None:
        if sent == 0 and self._now("crash-before-send"):
            await self.engaged.wait()  # sender_accepted crashes then: hold our parts back
            self._crash()
        if sent == 1 and self._now("crash-mid-send"):
            await self.engaged.wait()
            self._crash()
        if sent == 1 and self._now("stall-send"):
            self.stalled += 1
            self._stall_marker()
            await asyncio.sleep(STALL_SECONDS)
        if sent == 1 and self._now("slow-send"):
            self._fire()
            await asyncio.sleep(SLOW_SECONDS)
        if self._now("trickle-send"):
            self._fire()
            await asyncio.sleep(TRICKLE_SECONDS)

    def contribution(self) -> None:
        if self._now("crash-while-reducing"):
            self.reducing = True
            if self.engaged.is_set():
                self._crash()

    async def before_result(self, sent: int, payload: memoryview | bytes, codec: Codec,
                            numel: int, dtype: np.dtype) -> memoryview | bytes:
        if self._now("stall-reduce"):
            self._fire()
            await asyncio.sleep(STALL_SECONDS)
        if payload and self.kind == "lie-results" and self.rounds >= self.at_round:
            self._fire()
            return codec.encode(np.full(numel, 1000.0, dtype=np.float32))
        if sent == 0 and payload and self._now("poison-results"):  # the first result only
            self._fire()
            return poisoned(codec, payload, numel, dtype)
        return payload

    async def serving_state(self, chunks_sent: int) -> None:
        """A donor streaming a range of its state to a joiner, `chunks_sent` chunks in (it
        lets them reach the joiner before it dies)."""
        if self.kind == "die-mid-serve" and chunks_sent == 2:
            await asyncio.sleep(0.5)
            self._crash()

    def relayed(self, data: bytes) -> bytes:
        if self.kind != "tamper-relay":
            return data
        self.relayed_bytes += len(data)
        if self.relayed_bytes < TAMPER_AFTER:
            return data
        self._fire()
        return data[:-1] + bytes([data[-1] ^ 1])

    def leading(self, group: Group) -> Group:
        if self.kind != "tamper-group":
            return group
        how = TAMPERINGS[self.led % len(TAMPERINGS)]
        self.led += 1
        if self.marker:
            with open(self.marker, "w") as f:
                f.write(how)
        return tampered(group, how)
