"""A host's local trainers meeting under a key, then averaging with the swarm as one peer.

One LocalGroup per key and round. The first request under the key opens it with its round
clock; the group closes when all `local_world` trainers came, or at the clock's local deadline.

- Replicas (no local_rank): each holds a full copy. At the deadline the group goes on with
  those that came; one that left or came late is left out. Their weighted mean is reduced into
  a scratch vector (moshpitd/local/reduce.py), which takes part in the swarm round with the
  sum of their weights; the result is then written to every contributor's buffer. A replica's
  rank is its order of arrival.
- Shards (local_rank r): the ranks' tensors in rank order are the host's vector
  (moshpitd/local/shards.py). A rank that leaves or never comes fails every rank with
  LocalRankMissing before anything is sent.

Trainers that disagree with the first (local_world, the mode, the options of the round, and
for replicas the tensors) are refused with LocalMismatch naming their rank; for shards the
whole group fails, since its vector can no longer be complete.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import numpy as np

from moshpitd import timebase
from moshpitd.allreduce.layout import FlatView, LayoutError, TensorSpec, schema_of
from moshpitd.clock import RoundClock
from moshpitd.local.errors import LocalLate, LocalMismatch, LocalRankMissing
from moshpitd.local.reduce import Scratch, copy_out, tensor_arrays, weighted_mean
from moshpitd.local.shards import ShardView
from moshpitd.matchmaking.errors import DuplicateRequest
from moshpitd.node_config import ShuttingDown
from moshpitd.rounds import AverageRequest, AverageResult

log = logging.getLogger("moshpitd.node")

# How the group averages its host's vector with the swarm: the node's own path for a request
SwarmAverage = Callable[[AverageRequest, FlatView], Awaitable[AverageResult]]
AGREED = ("codec", "aggregation", "group_size", "min_group_size", "grid", "rounds",
          "initial_coords")  # every local trainer of a group must ask for the same round


@dataclass(eq=False)
class Member:
    rank: int  # a shard's rank; a replica's order of arrival
    request: AverageRequest
    view: FlatView
    arrays: list[np.ndarray]  # its tensors in its buffer, flat
    arrived: float
    future: asyncio.Future[AverageResult] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())

    def answer(self, result: AverageResult | BaseException) -> None:
        if self.future.done():  # gone (cancelled), or refused earlier
            return
        if isinstance(result, BaseException):
            self.future.set_exception(result)
        else:
            self.future.set_result(result)


def disagreement(first: AverageRequest, new: AverageRequest, shards: bool) -> str | None:
    """What `new` asks otherwise than the group's first request; None when they agree."""
    if new.local_world != first.local_world:
        return f"says local_world={new.local_world}, the first said {first.local_world}"
    if (new.local_rank is not None) != shards:
        mode = "shards (local_rank given)" if shards else "replicas (no local_rank)"
        return f"is in the other mode: the group holds {mode}"
    for name in AGREED:
        if getattr(new, name) != getattr(first, name):
            return f"asks {name}={getattr(new, name)!r}, the first asked {getattr(first, name)!r}"
    if not shards and schema_of(new.specs) != schema_of(first.specs):
        ours, theirs = schema_of(new.specs), schema_of(first.specs)
        if len(ours) != len(theirs):
            return f"sent {len(ours)} tensors, the first sent {len(theirs)}"
        i = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
        return (f"sent tensor {i} as {ours[i][0]} {list(ours[i][1])}, the first as "
                f"{theirs[i][0]} {list(theirs[i][1])}")
    return None


class LocalGroup:
    def __init__(self, first: AverageRequest, clock: RoundClock, swarm: SwarmAverage,
                 done: Callable[[LocalGroup], None]) -> None:
        assert first.local_world is not None
        self.key = first.key
        self.first = first
        self.world = first.local_world
        self.shards = first.local_rank is not None
        self.clock = clock
        self.swarm = swarm
        self.done = done
        self.members: dict[int, Member] = {}
        self.arrivals = 0
        self.state = "gathering"  # then "averaging", then "done"
        self.task: asyncio.Task[None] | None = None
        wait = max(clock.local_deadline() - timebase.monotonic(), 0.0)
        self._timer = asyncio.get_running_loop().call_later(wait, self._deadline)

    def admit(self, request: AverageRequest, view: FlatView, buffer: memoryview) -> Member:
        rank = request.local_rank if request.local_rank is not None else self.arrivals
        problem = disagreement(self.first, request, self.shards)
        if problem is None and rank in self.members:
            problem = "came twice: another trainer holds that rank"
        if problem is not None:
            error = LocalMismatch(rank, f"local group under key {self.key!r}: local rank "
                                  f"{rank} {problem}")
            if self.shards:  # the host's vector can no longer be complete
                self._fail(error)
            raise error
        self.arrivals += 1
        member = Member(rank, request, view, tensor_arrays(buffer, request.specs),
                        timebase.monotonic())
        self.members[rank] = member
        if len(self.members) == self.world:
            self._close()
        return member

    def leave(self, member: Member) -> None:
        """Its trainer went away (the request was cancelled, the session ended)."""
        if self.state == "gathering":
            del self.members[member.rank]
            if self.shards:
                self._fail(LocalRankMissing(member.rank, (
                    f"local rank {member.rank} under key {self.key!r} went away before the "
                    "round (its request was cancelled or its process ended): the host's vector "
                    "is incomplete, nothing was sent")))
            elif not self.members:
                self._finish()
        elif self.state == "averaging" and self.task is not None and all(
                m.future.done() for m in self.members.values()):
            self.task.cancel("every local trainer went away")  # the round leaves the group

    def fail_gathering(self, error: BaseException) -> None:
        if self.state == "gathering":
            self._fail(error)

    def _deadline(self) -> None:
        if self.state != "gathering":
            return
        if not self.shards:
            self._close()
            return
        missing = [r for r in range(self.world) if r not in self.members]
        self._fail(LocalRankMissing(missing[0], (
            f"local rank(s) {missing} of {self.world} under key {self.key!r} did not come "
            f"within the local deadline ({self.clock.local_deadline() - self.clock.start:.1f} s "
            "after the first): the host's vector is incomplete, nothing was sent")))

    def _close(self) -> None:
        self.state = "averaging"
        self._timer.cancel()
        self.task = asyncio.create_task(self._run(), name=f"local-round-{self.key}")

    def _fail(self, error: BaseException) -> None:
        for m in self.members.values():
            m.answer(error)
        self._finish()

    def _finish(self) -> None:
        self.state = "done"
        self._timer.cancel()
        self.done(self)

    async def _run(self) -> None:
        members = sorted(self.members.values(), key=lambda m: m.rank)
        try:
            if self.shards:
                await self._average_shards(members)
            else:
                await self._average_replicas(members)
        except asyncio.CancelledError:
            for m in members:
                m.answer(ShuttingDown("moshpitd is shutting down: the local group's round was "
                                      "cut off"))
            raise
        except Exception as exc:  # the swarm round's failure is every member's
            for m in members:
                m.answer(exc)
        finally:
            self._finish()

    def _swarm_request(self, members: list[Member], specs: tuple[TensorSpec, ...]
                       ) -> AverageRequest:
        """The host's request: one peer, with the sum of the members' weights, ending when the
        first of their requests would."""
        final = min(m.arrived + m.request.timeout for m in members)
        remaining = final - timebase.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"the local group under key {self.key!r} used the whole "
                               "request's time waiting for its trainers")
        return replace(self.first, specs=specs, weight=sum(m.request.weight for m in members),
                       timeout=remaining, local_world=None, local_rank=None)

    async def _average_replicas(self, members: list[Member]) -> None:
        started = timebase.monotonic()
        scratch = Scratch(self.first.specs)
        while True:  # a replica with NaN or Inf is refused, and the others reduced again
            bad = await asyncio.to_thread(weighted_mean, scratch.arrays,
                                          [m.arrays for m in members],
                                          [m.request.weight for m in members])
            if not bad:
                break
            for i, tensor in bad.items():
                members[i].answer(LayoutError(f"tensor {tensor} contains NaN or Inf: refusing "
                                              "to average it"))
            members = [m for i, m in enumerate(members) if i not in bad]
            if not members:
                return
        reduced = timebase.monotonic()
        request = self._swarm_request(members, scratch.specs)
        ranks = tuple(m.rank for m in members)
        log.info("local round key=%s replicas=%s of %d weight=%g reduce_seconds=%.3f",
                 self.key, list(ranks), self.world, request.weight, reduced - started)
        result = await self.swarm(request, scratch.view)
        await asyncio.to_thread(copy_out, scratch.arrays, [m.arrays for m in members])
        for m in members:
            m.answer(replace(result, local_rank=m.rank, local_ranks=ranks))

    async def _average_shards(self, members: list[Member]) -> None:
        view = ShardView([m.view for m in members])
        request = replace(self._swarm_request(members, tuple(view.specs)),
                          rank_digests=view.rank_digests())
        ranks = tuple(range(self.world))
        log.info("local round key=%s shards=%d elements=%d weight=%g", self.key, self.world,
                 view.first_element[-1], request.weight)
        result = await self.swarm(request, view)
        for m in members:
            m.answer(replace(result, spans=view.rank_spans(result.spans, m.rank),
                             local_rank=m.rank, local_ranks=ranks))


class LocalGroups:
    """The daemon's local groups, by key. `busy(key)`: a plain request averages under it."""

    def __init__(self, swarm: SwarmAverage, clock: Callable[[float], RoundClock],
                 busy: Callable[[str], bool]) -> None:
        self.swarm = swarm
        self.clock = clock
        self.busy = busy
        self.groups: dict[str, LocalGroup] = {}

    def holds(self, key: str) -> bool:
        return key in self.groups

    def status(self) -> dict[str, dict[str, object]]:
        """Each key's group: its mode, local_world, the ranks in it, and whether it still
        gathers or averages with the swarm."""
        return {key: {"mode": "shards" if g.shards else "replicas", "local_world": g.world,
                      "ranks": sorted(g.members), "state": g.state}
                for key, g in sorted(self.groups.items())}

    async def join(self, request: AverageRequest, view: FlatView, buffer: memoryview
                   ) -> AverageResult:
        group = self.groups.get(request.key)
        if group is not None and group.state != "gathering":
            raise LocalLate(f"the local group under key {request.key!r} left for its swarm "
                            f"round without this trainer (it came after the local deadline, "
                            f"or after all {group.world} had come): it keeps its values")
        if group is None:
            if self.busy(request.key):
                raise DuplicateRequest(f"this daemon is already averaging under key "
                                       f"{request.key!r} for a trainer without local_world")
            group = LocalGroup(request, self.clock(request.timeout), self.swarm, self._done)
            self.groups[request.key] = group
        member = group.admit(request, view, buffer)
        try:
            return await member.future
        except asyncio.CancelledError:
            group.leave(member)
            raise

    def drain(self) -> None:
        """Groups still gathering go no further; those averaging end with their round."""
        for group in list(self.groups.values()):
            group.fail_gathering(ShuttingDown("moshpitd is shutting down: it takes no new "
                                              "rounds"))

    def _done(self, group: LocalGroup) -> None:
        if self.groups.get(group.key) is group:
            del self.groups[group.key]


__all__ = ["LocalGroup", "LocalGroups", "Member", "disagreement"]
