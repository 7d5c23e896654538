"""One peer's search for a group under one key.

Every peer declares itself in the DHT with a deadline, and is at once a potential leader (it
accepts followers) and a follower (it asks earlier-ranked peers to take it). Peers only ask peers
ranked strictly before them, so waits cannot form a cycle. A peer that joins a leader stops
accepting and redirects its own followers to that leader, so groups merge.

The Matchmaker does the I/O: DHT reads, probes, Join calls and waits. Our side as a leader is
a `GroupLeader` (leading.py); when to assemble is the pure `AssemblyPolicy` (assembly.py),
asked once per poll; every deadline of an attempt comes from its `AttemptClock` (clock.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from functools import partial

from moshpitd import timebase
from moshpitd.allreduce.group import Group
from moshpitd.clock import LEADER_GRACE, AttemptClock
from moshpitd.dht.network import DHTNode
from moshpitd.dht.records import Proof
from moshpitd.hooks import NO_HOOKS, Hooks
from moshpitd.matchmaking.assembly import Action, AssemblyPolicy, Poll
from moshpitd.matchmaking.declaration import MAX_TTL as DECLARATION_TTL
from moshpitd.matchmaking.declaration import Candidate, Declaration, in_background
from moshpitd.matchmaking.errors import GroupNotFound, MatchmakingError, NoPartners, SchemaMismatch
from moshpitd.matchmaking.leading import GroupLeader, JoinAdmission, join_request, not_looking
from moshpitd.matchmaking.liveness import Probe, Vitals
from moshpitd.matchmaking.request import LineStatus, LineWatcher, MatchRequest, Self
from moshpitd.matchmaking.shunned import SHUN_SECONDS
from moshpitd.matchmaking.signing import PeerAuth
from moshpitd.matchmaking.vetting import DeclarationBook, entries_fault, shape_fault
from moshpitd.proto import moshpit_pb2 as pb
from moshpitd.transport.control import Answers, ControlClient, ControlError

log = logging.getLogger(__name__)

# Protocol constants: how often we look at the DHT and at peers. Each is a latency of one DHT
# read or Join call, the same for any attempt length or data-plane rate, so none is derived.
# A peer polls the DHT at MIN_POLL after anything happened, backing off by POLL_BACKOFF up to
# MAX_POLL while nothing does (a DHT read costs a few ms; a joining follower wakes us at once).
MIN_POLL = 0.02  # s
MAX_POLL = 0.5  # s
POLL_BACKOFF = 1.5
# How soon to ask again a leader that turned us away: a refusal may be momentary.
RETRY_ASK = 0.25  # s
# No new attempt with less than this left: declaring alone takes longer.
MIN_ATTEMPT = 0.01  # s
# Redirects (NOT_A_LEADER, DISBANDED) followed in a row before we look at the DHT again: groups
# merge in one or two hops; a longer chain is a loop of stale views.
MAX_HOPS = 4
# A withdrawn declaration lives long enough for every member of the group we found to check
# our entry against it (their GroupInfo arrives within a few ms of ours).
WITHDRAWN_TTL = 30.0  # s


class Matchmaker:
    def __init__(self, me: Self, dht: DHTNode, pool: ControlClient, request: MatchRequest,
                 watcher: LineWatcher | None = None, probe: Probe | None = None,
                 hooks: Hooks = NO_HOOKS) -> None:
        self.me = me
        # declared, but its daemon does not answer, or it led a group that failed our checks
        self._dead: set[bytes] = me.shunned.current() | me.liars.current()
        self.vitals = Vitals(request.key, self._dead, me.liveness, probe)
        self.watcher = watcher
        self.expected = request.expected
        self.settled = True
        self.dht = dht
        self.pool = pool
        self.req = request
        self._wake = asyncio.Event()
        self.book = DeclarationBook(lambda: dht.get_subs(request.key, max_ttl=DECLARATION_TTL),
                                    (me.peer_id, self.declaration),
                                    lambda: dht.local_subs(request.key, DECLARATION_TTL),
                                    verify=partial(dht.verify_sub, request.key))
        self.leading = GroupLeader(me, request, self._wake.set, self.book, hooks)
        self.policy = AssemblyPolicy(request.target_size, request.min_size,
                                     request.settle_seconds)
        self.assembled: asyncio.Future[Group] = asyncio.get_running_loop().create_future()
        self._clock = AttemptClock(0.0, request.attempt_seconds)
        self._seen_mismatch: set[bytes] = set()
        self._mismatch_ranks: dict[bytes, bytes] = {}  # their rank digests, if a shard host
        self._seen_match: set[bytes] = set()
        self._declared_now: set[bytes] = set()
        self._read_last: dict[bytes, Candidate] = {}  # the latest read's candidates
        self._carried: tuple[bytes, int, Proof] | None = None  # this attempt's declaration
        self._version = 0

    @property
    def last_join(self) -> float:
        """When the latest follower joined us (the runner learns arrival spread from it)."""
        return self.leading.last_join

    def handle_join(self, request: pb.JoinRequest, tls_binding: bytes = b"",
                    admission: JoinAdmission | None = None) -> AsyncIterator[pb.JoinResponse]:
        """The server side of Join, routed here by key."""
        return self.leading.handle_join(request, tls_binding, admission)

    @property
    def declaration(self) -> Declaration:
        """Our entry in any group, as every member will check it."""
        return Declaration(self.me.endpoint, self.req.schema_hash, self.req.client_mode,
                           self.me.data_endpoint, self.req.weight, self.me.bandwidth,
                           ranks=self.req.rank_digests)

    # --- the whole search ---------------------------------------------------------------------
    async def find_group(self, timeout: float) -> Group:
        final = timebase.monotonic() + timeout
        with self.vitals.waking(self._wake.set):
            return await self._search(final, timeout)

    async def _search(self, final: float, timeout: float) -> Group:
        attempts = 0
        while timebase.monotonic() < final - MIN_ATTEMPT:
            attempts += 1
            self._clock = AttemptClock.starting(timebase.monotonic(), self.req.attempt_seconds,
                                                final)
            ttl = self._clock.deadline - timebase.monotonic()
            self._version = self.dht.next_version()
            self.leading.open()  # before anyone can read the declaration
            # Declared while the first poll reads the key: our store's datagrams leave first,
            # so they reach the holders before any Join that follows the read (leaders vet it)
            self.dht.check_record(self.req.key, self.me.peer_id, packed := self.declaration.pack())
            proof = self.dht.sign_sub(self.req.key, packed, ttl, self._version)
            self._carried = (packed, self._version, proof)  # our joins carry it
            in_background(asyncio.ensure_future(self.dht.store_sub(
                self.req.key, self.me.peer_id, packed, ttl, version=self._version, proof=proof)))
            group = None
            try:
                group = await self._attempt(final)
            finally:
                self.leading.close()
                if group is None and self.leading.followers:  # leaving (cancelled, failed)
                    self.leading.disband(None, "the leader left the round")
                self._start_withdraw()
            if group is not None:
                return group
            if self._seen_mismatch and not self._seen_match:
                raise SchemaMismatch(
                    f"{len(self._seen_mismatch)} peer(s) under key {self.req.key!r} declared "
                    "tensors with other dtypes or shapes (or another order, wire codec, "
                    "aggregation, daemon part_size or data_encryption), and none matched ours; "
                    "peers of a group submit the same shapes and dtypes with the same codec and "
                    "aggregation, on daemons with the same part_size and data_encryption",
                    self.req.rank_digests, self._mismatch_ranks)
        raise GroupNotFound(
            f"no group of at least {self.req.min_size} peers under key {self.req.key!r} within "
            f"{timeout:.1f} s ({attempts} attempt(s); {len(self._seen_match)} matching peer(s) "
            f"seen)"
        )

    def _start_withdraw(self) -> None:
        """In the background: a dead DHT node must not delay the round that follows."""
        # its version is taken now: below the next declaration, which may reach the DHT first
        in_background(asyncio.ensure_future(self._withdraw(self.dht.next_version())))

    async def _withdraw(self, version: int) -> None:
        try:
            await self.dht.store_sub(self.req.key, self.me.peer_id,
                                     self.declaration.withdraw().pack(), WITHDRAWN_TTL,
                                     version=version)
        except Exception as exc:  # the round goes on; the record expires by itself
            log.debug("withdraw failed: %r", exc)

    async def _attempt(self, final: float) -> Group | None:
        tried: dict[bytes, float] = {}  # candidate -> when we may ask it again
        poll = MIN_POLL
        read: tuple[list[Candidate], LineStatus | None] | None = None
        while True:
            self._wake.clear()  # what happens from here on (a join, a probe's answer) wakes us
            if self.assembled.done():
                return self.assembled.result()
            now = timebase.monotonic()
            self._release_expired(now)
            if self.leading.accepting and self.policy.full(len(self.leading.followers)):
                return self._assemble()  # full: no need to look at the DHT first
            # woken by a joiner, only our group changed: the DHT is read at the poll's timeout
            if read is None:
                read = await self._read_by(self._clock.deadline)
            candidates, line = read
            self._release_expired(timebase.monotonic())  # by what this read says
            candidates = self.vitals.proven(candidates, self.leading.followers)
            if self.leading.followers:
                await self.vitals.probe_stragglers(candidates, self.leading.followers, now)
            candidates = [c for c in candidates if c.peer_id not in self._dead]
            awaited = await self.vitals.partners_coming(self.req.partners, self._seen_match,
                                                        self.leading.followers, now)
            if line is not None:
                # a line-mate found dead (its declaration outlives it) is not waited for
                self.expected = line.expected - self._dead
                self.settled = line.settled
            decision = self.policy.decide(self._clock, self._poll(now, candidates, line,
                                                                  awaited))
            if decision.action is Action.ALONE:
                raise NoPartners(f"no other peer on this grid line under {self.req.key!r}")
            if self.assembled.done():
                return self.assembled.result()
            if decision.action is Action.ASSEMBLE:
                return self._assemble()
            if decision.action is Action.GIVE_UP:
                self.leading.disband(None)
                return None
            my_rank = (self._version, self.me.peer_id)
            log.debug("%s: %d candidates, %d followers, %d before us", self.me.peer_id.hex()[:6],
                      len(candidates), len(self.leading.followers),
                      sum(c.rank < my_rank for c in candidates))
            for cand in self.vitals.asking_order(candidates):
                # A client-mode peer never leads, so it may follow anyone: no cycle can form.
                later = cand.rank >= my_rank and not self.req.client_mode
                if later or tried.get(cand.peer_id, 0.0) > timebase.monotonic():
                    continue
                if cand.declaration.client_mode:
                    continue
                # a refusal may be momentary (it was between attempts): ask again later
                tried[cand.peer_id] = timebase.monotonic() + RETRY_ASK
                group = await self._follow(cand, final)
                if group is not None:
                    return group
                if self.assembled.done():
                    return self.assembled.result()
            try:
                wake_at = min(decision.wake_at, self.leading.next_release(self._deadlines()))
                async with asyncio.timeout(min(poll, max(wake_at - timebase.monotonic(), 0))):
                    await self._wake.wait()
                poll = MIN_POLL
            except TimeoutError:
                poll, read = min(poll * POLL_BACKOFF, MAX_POLL), None

    def _release_expired(self, now: float) -> None:
        if self.leading.followers and self.leading.release_expired(self._deadlines(), now):
            self._wake.set()  # membership changed: decide again before sleeping

    def _deadlines(self) -> dict[bytes, float]:
        """Each peer's attempt's end, by the latest read of its declaration."""
        return {p: c.deadline for p, c in self._read_last.items()}

    def _assemble(self) -> Group:
        group = self.leading.assemble()
        if not self.assembled.done():
            self.assembled.set_result(group)
        return group

    def _poll(self, now: float, candidates: list[Candidate], line: LineStatus | None,
              awaited: frozenset[bytes] = frozenset()) -> Poll:
        """What the policy needs of this poll (read before any await: nothing moves under it)."""
        return Poll(now, self.leading.members, {c.peer_id: c.deadline for c in candidates},
                    accepting=self.leading.accepting, following=self.leading.following is not None,
                    expected=self.expected, settled=self.settled,
                    gone=frozenset(self._seen_match - self._declared_now), line=line,
                    awaited=awaited)

    async def _read_by(self, deadline: float) -> tuple[list[Candidate], LineStatus | None]:
        """`_read`, given up at our deadline: a lookup that waits on silent DHT nodes must not
        keep us from disbanding our followers then (they shun a leader that overruns)."""
        try:
            async with asyncio.timeout(max(deadline - timebase.monotonic(), 0.0) + MIN_POLL):
                return await self._read()
        except TimeoutError:
            return [], None

    async def _read(self) -> tuple[list[Candidate], LineStatus | None]:
        """The key's declarations and the grid line's status, read side by side."""
        reading = asyncio.ensure_future(self._candidates())
        try:  # cancelled only if the line's read failed, or we were
            line = None if self.watcher is None else await self.watcher()
            return await reading, line
        finally:
            reading.cancel()

    async def _candidates(self) -> list[Candidate]:
        subs = await self.dht.get_subs(self.req.key, max_ttl=DECLARATION_TTL)
        self.book.absorb(subs)
        now = timebase.monotonic()
        out = []
        self._declared_now = set()
        for peer_id, rec in subs.items():
            if peer_id == self.me.peer_id:
                continue
            decl = Declaration.unpack(rec.value)
            if decl is None or decl.withdrawn:
                continue
            if decl.schema_hash != self.req.schema_hash:
                self._seen_mismatch.add(peer_id)
                if decl.ranks:
                    self._mismatch_ranks[peer_id] = decl.ranks
                continue
            self._seen_match.add(peer_id)
            if self._clock.outlived_by(now + rec.ttl, self.req.longest_attempt):
                continue  # not an honest attempt's: neither followed nor waited for
            self._declared_now.add(peer_id)
            out.append(Candidate(peer_id, decl, now + rec.ttl, rec.version))
        self._read_last = {c.peer_id: c for c in out}
        return out

    async def _vet(self, group: Group) -> str | None:
        """Why we must leave the group our leader sent, or None: the codec, aggregation and
        tensors we asked for, a mean reducers can compute, and every member, us included,
        as it declared itself under the key."""
        why = shape_fault(group, self.req, self.me.peer_id)
        if why is None:
            why = await self.book.vouched(lambda get: entries_fault(group, self.req, get))
        return why

    # --- following --------------------------------------------------------------------------
    async def _follow(self, leader: Candidate, final: float) -> Group | None:
        """Ask leader (and any leader it redirects us to) to take us; None if nobody did."""
        hops = 0
        while hops < MAX_HOPS:
            hops += 1
            request = join_request(self.me, self.req, leader.peer_id, self._carried)
            remaining = final - timebase.monotonic()
            if remaining <= 0:
                return None
            call = self.pool.join(leader.declaration.endpoint, request, timeout=remaining)
            self.leading.asking = leader.peer_id
            try:
                nxt = await self._follow_call(call, leader)
                log.debug("%s: join %s -> %s", self.me.peer_id.hex()[:6],
                          leader.peer_id.hex()[:6], type(nxt).__name__)
            except (ControlError, TimeoutError) as exc:
                log.debug("join %s failed: %r", leader.peer_id.hex()[:8], exc)
                nxt = None
            finally:
                self.leading.asking = None
                call.cancel()
                if self.leading.following is not None and not self.assembled.done():
                    self.leading.unfollow(timebase.monotonic() < self._clock.deadline)
            if isinstance(nxt, Group):
                return nxt
            if nxt is None:
                return None
            leader = nxt
        return None

    async def _follow_call(self, call: Answers[pb.JoinResponse], leader: Candidate
                           ) -> Group | Candidate | None:
        async with asyncio.timeout(self._clock.answer_wait(timebase.monotonic())):
            first = await call.read()
        if first is None:
            return None
        log.debug("%s: %s answers %s %s", self.me.peer_id.hex()[:6], leader.peer_id.hex()[:6],
                  pb.JoinCode.Name(first.code), first.message)
        if first.code == pb.ACCEPTED:
            self.leading.follow(leader)
            # A leader that accepts and never assembles (a cycle of inconsistent views, or one
            # that means to stall us) holds us to our own deadline at most; one that outlives
            # its own declaration so is not asked again for SHUN_SECONDS, by any request.
            try:
                async with asyncio.timeout(self._clock.group_info_wait(timebase.monotonic(),
                                                                       leader.deadline)):
                    resp = await call.read()
            except TimeoutError:
                if timebase.monotonic() >= leader.deadline + LEADER_GRACE:
                    # it outlived its own declaration without a word: an honest leader
                    # assembles or disbands by then
                    log.info("%s: leader %s accepted us and neither assembled nor disbanded "
                             "by its own deadline; not asking it for %.0f s", self.req.key,
                             leader.peer_id.hex()[:8], SHUN_SECONDS)
                    self._dead.add(self.me.shunned.add(leader.peer_id))
                else:  # our attempt ended first: an honest leader may still be gathering
                    log.info("%s: leader %s accepted us and did not assemble within our "
                             "attempt", self.req.key, leader.peer_id.hex()[:8])
                return None
            if resp is None:
                return None
        else:
            resp = first
        if resp.code == pb.GROUP_ASSEMBLED:
            group = Group.from_proto(resp.group_info)
            why = PeerAuth.check_group(resp.group_info, group, leader.peer_id,
                                       self.req.attempt_seconds)
            if why is None:  # signed by the leader we asked: then vet what it says
                for admission in resp.group_info.admissions:  # (their signed declarations)
                    self.book.carried(admission.join)
                why = await self._vet(group)
            if why is not None:
                log.warning("%s: left the group %s that %s led: %s", self.req.key,
                            group.group_id.hex()[:8], leader.peer_id.hex()[:8], why)
                self._dead.add(leader.peer_id)  # never again in this request
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
            seen = self._read_last.get(resp.suggested_leader_id)  # its own deadline, if read
            return Candidate(resp.suggested_leader_id,
                             Declaration(resp.suggested_leader, self.req.schema_hash),
                             leader.deadline if seen is None else seen.deadline,
                             leader.version)
        return None

__all__ = ["MatchRequest", "Matchmaker", "MatchmakingError", "Self", "not_looking"]
