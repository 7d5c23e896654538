"""One peer's search for a group under one key.

Every peer declares itself in the DHT with a deadline, and is at once a potential leader (it
accepts followers) and a follower (it asks earlier-ranked peers to take it). Peers only ask peers
ranked strictly before them, so waits cannot form a cycle. A peer that joins a leader stops
accepting and redirects its own followers to that leader, so groups merge. A leader assembles as
soon as the group reaches its target size, as soon as every peer declared under the key is in its
group, or at its deadline with at least the minimum size.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from grpc import aio

from moshpitd.allreduce.group import Group
from moshpitd.dht.network import DHTNode
from moshpitd.matchmaking.declaration import MAX_TTL as DECLARATION_TTL
from moshpitd.matchmaking.declaration import Candidate, Declaration
from moshpitd.matchmaking.errors import (
    GroupNotFound,
    MatchmakingError,
    NoPartners,
    SchemaMismatch,
)
from moshpitd.matchmaking.leading import PROTOCOL_VERSION, Leading, _Follower, not_looking
from moshpitd.matchmaking.request import LineStatus, LineWatcher, MatchRequest, Self
from moshpitd.proto import moshpit_pb2 as pb
from moshpitd.transport.grpc_server import ChannelPool

Probe = Callable[[str], Awaitable[bool]]

log = logging.getLogger(__name__)

_BACKGROUND: set[asyncio.Task[None]] = set()  # withdrawals in flight, owned until done


async def wait_background() -> None:
    """Let withdrawals in flight reach the DHT (a draining daemon waits for them)."""
    if _BACKGROUND:
        await asyncio.gather(*list(_BACKGROUND), return_exceptions=True)


MIN_POLL = 0.02
MAX_POLL = 0.5
STRAGGLER_PROBE = 0.3  # a declared peer this long outside our group gets asked if it lives
RETRY_ASK = 0.25  # how soon to ask a leader again that turned us away
# A group below its target assembles this long before the earliest deadline among its members,
# at most a tenth of an attempt: followers give up at their deadline, the GroupInfo must reach
# them first (a poll of the DHT comes between waking up and assembling).
ASSEMBLY_LEAD = 0.2


class Matchmaker(Leading):
    def __init__(self, me: Self, dht: DHTNode, pool: ChannelPool, request: MatchRequest,
                 watcher: LineWatcher | None = None, probe: Probe | None = None) -> None:
        self.me = me
        self.probe = probe
        self._outside_since: dict[bytes, float] = {}
        self._dead: set[bytes] = set()  # declared, but its daemon does not answer
        self.watcher = watcher
        self.expected = request.expected
        self.settled = True
        self._lonely_polls = 0
        self.dht = dht
        self.pool = pool
        self.req = request
        self.accepting = False
        self.leader: Candidate | None = None
        self.followers: dict[bytes, _Follower] = {}
        self.assembled: asyncio.Future[Group] = asyncio.get_running_loop().create_future()
        self._wake = asyncio.Event()
        self._deadline = 0.0
        self._seen_mismatch: set[bytes] = set()
        self._seen_match: set[bytes] = set()
        self._declared_now: set[bytes] = set()
        self._stable_members: frozenset[bytes] = frozenset()
        self._stable_since = 0.0
        self.last_join = 0.0  # when the latest follower joined us (to learn arrival spread)
        self._version = 0
        self._asking: bytes | None = None  # the peer we are asking to lead us, if any

    @property
    def declaration(self) -> Declaration:
        return Declaration(self.me.endpoint, self.req.schema_hash, self.req.client_mode)

    # --- the whole search ---------------------------------------------------------------------
    async def find_group(self, timeout: float) -> Group:
        final = time.monotonic() + timeout
        attempts = 0
        while time.monotonic() < final - 0.01:
            attempts += 1
            self._deadline = min(time.monotonic() + self.req.attempt_seconds, final)
            ttl = self._deadline - time.monotonic()
            self._version = self.dht.next_version()
            # accept before anyone can read the declaration, or early askers get NOT_LOOKING
            self.accepting = not self.req.client_mode
            await self.dht.store_sub(self.req.key, self.me.peer_id, self.declaration.pack(), ttl,
                                     version=self._version)
            group = None
            try:
                group = await self._attempt(final)
            finally:
                self.accepting = False
                if group is None and self.followers:  # leaving (cancelled, failed): say so
                    self._disband(None, "the leader left the round")
                self._start_withdraw()
            if group is not None:
                return group
            if self._seen_mismatch and not self._seen_match:
                raise SchemaMismatch(
                    f"{len(self._seen_mismatch)} peer(s) under key {self.req.key!r} declared "
                    "tensors with other dtypes or shapes (or another order, wire codec, "
                    "aggregation or daemon part_size), and none matched ours; every peer of a "
                    "group must submit the same list of shapes and dtypes with the same codec "
                    "and aggregation, and every daemon use the same part_size"
                )
        raise GroupNotFound(
            f"no group of at least {self.req.min_size} peers under key {self.req.key!r} within "
            f"{timeout:.1f} s ({attempts} attempt(s); {len(self._seen_match)} matching peer(s) "
            f"seen)"
        )

    def _start_withdraw(self) -> None:
        """In the background: a dead DHT node must not delay the round that follows."""
        # the tombstone's version is taken now: it must rank below the next attempt's
        # declaration, which may reach the DHT before this task does
        task = asyncio.ensure_future(self._withdraw(self.dht.next_version()))
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)

    async def _withdraw(self, version: int) -> None:
        try:
            await self.dht.withdraw_sub(self.req.key, self.me.peer_id, version=version)
        except Exception as exc:  # the round goes on; the record expires by itself
            log.debug("withdraw failed: %r", exc)

    async def _attempt(self, final: float) -> Group | None:
        tried: dict[bytes, float] = {}  # candidate -> when we may ask it again
        poll = MIN_POLL
        while True:
            if self.assembled.done():
                return self.assembled.result()
            if self.accepting and 1 + len(self.followers) >= self.req.target_size:
                return self._assemble()  # full: no need to look at the DHT first
            now = time.monotonic()
            candidates = await self._candidates()
            if self.probe is not None and self.followers:
                await self._probe_stragglers(candidates, now)
            candidates = [c for c in candidates if c.peer_id not in self._dead]
            if self.watcher is not None:
                status = await self.watcher()
                # a line-mate found dead (its declaration outlives it) is not waited for
                self.expected = status.expected - self._dead
                self.settled = status.settled
                self._check_lonely(candidates, status, now)
            if self.assembled.done():
                return self.assembled.result()
            assemble_at = self._assemble_at(candidates)
            if self.accepting and self._ready_to_assemble(candidates, now, assemble_at):
                return self._assemble()
            if now >= self._deadline:
                self._disband(None)
                return None
            my_rank = (self._version, self.me.peer_id)
            log.debug("%s: %d candidates, %d followers, %d before us", self.me.peer_id.hex()[:6],
                      len(candidates), len(self.followers),
                      sum(c.rank < my_rank for c in candidates))
            for cand in sorted(candidates, key=lambda c: c.rank):
                # A client-mode peer never leads, so it may follow anyone: no cycle can form.
                later = cand.rank >= my_rank and not self.req.client_mode
                if later or tried.get(cand.peer_id, 0.0) > time.monotonic():
                    continue
                if cand.declaration.client_mode:
                    continue
                # a refusal may be momentary (it was between attempts): ask again later
                tried[cand.peer_id] = time.monotonic() + RETRY_ASK
                group = await self._follow(cand, final)
                if group is not None:
                    return group
                if self.assembled.done():
                    return self.assembled.result()
            self._wake.clear()
            wake_at = assemble_at if now < assemble_at else self._deadline
            try:
                async with asyncio.timeout(min(poll, max(wake_at - time.monotonic(), 0))):
                    await self._wake.wait()
                poll = MIN_POLL
            except TimeoutError:
                poll = min(poll * 1.5, MAX_POLL)

    async def _candidates(self) -> list[Candidate]:
        subs = await self.dht.get_subs(self.req.key, max_ttl=DECLARATION_TTL)
        now = time.monotonic()
        out = []
        self._declared_now = set()
        for peer_id, rec in subs.items():
            if peer_id == self.me.peer_id:
                continue
            decl = Declaration.unpack(rec.value)
            if decl is None:
                continue
            if decl.schema_hash != self.req.schema_hash:
                self._seen_mismatch.add(peer_id)
                continue
            self._seen_match.add(peer_id)
            self._declared_now.add(peer_id)
            out.append(Candidate(peer_id, decl, now + rec.ttl, rec.version))
        return out

    def _plausible(self, group: Group) -> bool:
        """A leader's GroupInfo is trusted for membership, but not blindly: no more members than
        we asked for, no duplicates, sane weights, and our own entry as we sent it."""
        members = group.members
        ok = (len(members) <= self.req.target_size and len(group.group_id) == 16
              and len({m.peer_id for m in members}) == len(members)
              and all(math.isfinite(m.weight) and m.weight >= 0 for m in members)
              and members[group.index_of(self.me.peer_id)].weight == self.req.weight)
        if not ok:
            log.warning("%s: refused a malformed group from its leader", self.req.key)
        return ok

    async def _probe_stragglers(self, candidates: list[Candidate], now: float) -> None:
        """A killed daemon's declaration outlives it (until its TTL): a leader would wait for
        it until the deadline. Ask peers that stay outside once whether they live."""
        assert self.probe is not None
        ask = []
        for c in candidates:
            if (c.peer_id in self.followers or c.peer_id in self._dead
                    or c.declaration.client_mode):  # client-mode peers take no calls
                continue
            since = self._outside_since.setdefault(c.peer_id, now)
            if now - since >= STRAGGLER_PROBE:
                self._outside_since[c.peer_id] = math.inf  # once per request
                ask.append(c)
        if ask:
            alive = await asyncio.gather(*(self.probe(c.declaration.endpoint) for c in ask))
            for c, ok in zip(ask, alive, strict=True):
                if not ok:
                    log.info("%s: declared peer %s does not answer: not waiting for it",
                             self.req.key, c.peer_id.hex()[:8])
                    self._dead.add(c.peer_id)

    def _assemble_at(self, candidates: list[Candidate]) -> float:
        """When a group below its target assembles at the latest: before our deadline and
        before our followers' (their declarations' TTLs tell, whatever their clocks say)."""
        ends = [c.deadline for c in candidates if c.peer_id in self.followers]
        return min([self._deadline, *ends]) - min(ASSEMBLY_LEAD, self.req.attempt_seconds / 10)

    def _ready_to_assemble(self, candidates: list[Candidate], now: float,
                           assemble_at: float) -> bool:
        size = 1 + len(self.followers)
        if size >= self.req.target_size:
            return True
        if size < self.req.min_size:
            return False
        if now >= assemble_at:
            return True
        if self.expected is not None:
            if not self.settled:
                return False
            # Every expected peer is with us, or came and left for another group.
            return all(p in self.followers or (p in self._seen_match and p not in
                                               self._declared_now) for p in self.expected)
        # Everyone declared under the key is already with us, and nobody new declared for a
        # while: with no target in sight, waiting longer gains nothing.
        # (The clock runs from the last change of our membership, so an outsider found dead
        # costs no extra settle time once it is dropped.)
        outside = [c for c in candidates if c.peer_id not in self.followers]
        members = frozenset(self.followers)
        if members != self._stable_members:
            self._stable_members, self._stable_since = members, now
            return False
        return not outside and now - self._stable_since >= self.req.settle_seconds

    def _check_lonely(self, candidates: list[Candidate], status: LineStatus, now: float) -> None:
        """Nobody on our line is coming: keep our value instead of waiting for the deadline."""
        alone = (not self.followers and self.leader is None and not candidates
                 and not status.expected and status.settled)
        self._lonely_polls = self._lonely_polls + 1 if alone else 0
        started = self._deadline - self.req.attempt_seconds
        # the run moving on ends the wait early, but not before one grace period: a
        # line-mate that has not declared yet (it is starting) would be left behind a round
        grace = status.grace / 2 if status.moved_on else status.grace
        if alone and self._lonely_polls >= 2 and now - started >= grace:
            raise NoPartners(f"no other peer on this grid line under {self.req.key!r}")

    # --- following --------------------------------------------------------------------------
    async def _follow(self, leader: Candidate, final: float) -> Group | None:
        """Ask leader (and any leader it redirects us to) to take us; None if nobody did."""
        hops = 0
        while hops < 4:
            hops += 1
            request = pb.JoinRequest(
                group_key=self.req.key, peer_id=self.me.peer_id, endpoint=self.me.endpoint,
                schema_hash=self.req.schema_hash, weight=self.req.weight,
                client_mode=self.req.client_mode, protocol_version=PROTOCOL_VERSION,
                data_endpoint=self.me.data_endpoint, bandwidth=self.me.bandwidth,
                codec=self.req.codec,
            )
            remaining = final - time.monotonic()
            if remaining <= 0:
                return None
            call = self.pool.join(leader.declaration.endpoint, request, timeout=remaining)
            self._asking = leader.peer_id
            try:
                nxt = await self._follow_call(call, leader)
                log.debug("%s: join %s -> %s", self.me.peer_id.hex()[:6],
                          leader.peer_id.hex()[:6], type(nxt).__name__)
            except (aio.AioRpcError, TimeoutError) as exc:
                log.debug("join %s failed: %r", leader.peer_id.hex()[:8], exc)
                nxt = None
            finally:
                self._asking = None
                call.cancel()
                if self.leader is not None and not self.assembled.done():
                    self.leader = None
                    self.accepting = not self.req.client_mode and time.monotonic() < self._deadline
            if isinstance(nxt, Group):
                return nxt
            if nxt is None:
                return None
            leader = nxt
        return None

    async def _follow_call(self, call: Any, leader: Candidate) -> Group | Candidate | None:
        async with asyncio.timeout(max(min(2.0, self._deadline - time.monotonic()), 0.2)):
            first = await call.read()
        if first is aio.EOF:
            return None
        log.debug("%s: %s answers %s %s", self.me.peer_id.hex()[:6], leader.peer_id.hex()[:6],
                  pb.JoinCode.Name(first.code), first.message)
        if first.code == pb.ACCEPTED:
            self.leader = leader
            self.accepting = False
            self._disband(leader)
            # A leader that never assembles (say, caught in a cycle of inconsistent views) must
            # not hold us past its own deadline.
            patience = max(self._deadline, leader.deadline) + 1.0 - time.monotonic()
            try:
                async with asyncio.timeout(max(patience, 0.1)):
                    resp = await call.read()
            except TimeoutError:
                log.debug("%s: leader %s did not assemble in time", self.me.peer_id.hex()[:6],
                          leader.peer_id.hex()[:6])
                return None
            if resp is aio.EOF:
                return None
        else:
            resp = first
        if resp.code == pb.GROUP_ASSEMBLED:
            group = Group.from_proto(resp.group_info)
            try:
                group.index_of(self.me.peer_id)
            except KeyError:
                return None
            if group.schema_hash != self.req.schema_hash or not self._plausible(group):
                return None
            if not self.assembled.done():
                self.assembled.set_result(group)
            return group
        if resp.code == pb.BAD_SCHEMA:
            self._seen_mismatch.add(leader.peer_id)
            self._seen_match.discard(leader.peer_id)
        if resp.code in (pb.NOT_A_LEADER, pb.DISBANDED) and resp.suggested_leader:
            if resp.suggested_leader_id == self.me.peer_id:
                return None
            return Candidate(resp.suggested_leader_id,
                             Declaration(resp.suggested_leader, self.req.schema_hash),
                             leader.deadline, leader.version)
        return None

__all__ = ["MatchRequest", "Matchmaker", "MatchmakingError", "Self", "not_looking"]
