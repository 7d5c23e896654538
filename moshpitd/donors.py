"""Which donors a joiner takes its state from, judged from their signed donor records and
the headers they send (state.py downloads from them).

A version is taken only when another peer's record places the swarm near it (`vouched`): one
donor announcing a version far ahead of everyone captures no joiner. Donors of one version
rarely hold the same bytes (small groups average differently), so bytes are vouched for only
where they agree: if two holders of the version send the same header, theirs is taken
(`agreed`); otherwise that of the first to answer.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace
from typing import Any

import msgpack

from moshpitd.proto import moshpit_pb2 as pb
from moshpitd.transport.control import (
    FAILED_PRECONDITION,
    NOT_FOUND,
    ControlClient,
    ControlError,
)

log = logging.getLogger("moshpitd.state")

MAX_HEADER = 1 << 20  # bytes of a state header (tensor list, meta, one digest per range)
# Protocol constants of finding a donor, not options: none depends on the link or the swarm,
# and the request's own timeout bounds the whole search.
HEADER_WAIT_MAX = 5.0  # s for one donor to answer a header request (one small message): one
# that is hung or unreachable must not take the whole timeout from the other holders
HEADER_WAIT_MIN = 0.1  # s: a donor asked as the deadline passes still gets a real try

# How far beyond another donor's version a version may lie and still be vouched for: a trainer
# publishes its local step or, by default, its clock in ns, so the slack is 1024 steps, or
# 2^-24 of a clock version (about 100 s). One past it is a peer running ahead of the swarm.
VERSION_SLACK = 1024
VERSION_SLACK_SHIFT = 24
HEADER_AGREE_WAIT = 0.05  # s more for other holders' headers once the first came: the same
# small message, so a live holder answers within the first's round trip


@dataclass(frozen=True)
class Donor:
    peer_id: bytes
    endpoint: str
    version: int
    total: int


def slack(version: int) -> int:
    return max(VERSION_SLACK, version >> VERSION_SLACK_SHIFT)


def vouched(donors: list[Donor]) -> tuple[list[Donor], list[Donor]]:
    """The donors whose version another donor's record places the swarm near, and those
    refused: from the top, a version more than `slack` beyond the next one down is dropped
    (a refused record vouches for nothing). Records are one per peer id, each signed by its
    peer. A lone donor has nobody to be compared with: it is kept."""
    kept = sorted(donors, key=lambda d: d.version, reverse=True)
    refused = []
    while len(kept) >= 2 and kept[0].version > kept[1].version + slack(kept[1].version):
        refused.append(kept.pop(0))
    return kept, refused


def _check_header(info: Any, total: int) -> dict[str, Any]:
    """A donor's header must describe `total` bytes in digested ranges."""
    if not isinstance(info, dict):
        raise ValueError("state header is not a map")
    size, digests = info.get("range"), info.get("digests")
    if not (isinstance(size, int) and size > 0 and isinstance(digests, list)
            and len(digests) == -(-total // size)
            and all(isinstance(d, bytes) and len(d) == 16 for d in digests)):
        raise ValueError("state header does not describe its byte ranges")
    return info


Answer = tuple[Donor, dict[str, Any], bytes]  # a holder as it answered, the header, its bytes


async def headers(key: str, version: int, holders: list[Donor], pool: ControlClient,
                   wait: float) -> tuple[list[Answer], int]:
    """Asks the holders for the version's header at once: those that answered, first first,
    once the first answered and the others had HEADER_AGREE_WAIT more; and how many said they
    no longer have it."""
    async def ask(d: Donor) -> Answer:
        chunk = await _first(pool, d, pb.StateRequest(key=key, length=0, version=version), wait)
        info = _check_header(msgpack.unpackb(chunk.header), chunk.total)
        return replace(d, version=version, total=chunk.total), info, chunk.header

    tasks = {asyncio.ensure_future(ask(d)): d for d in holders}
    answers: list[Answer] = []
    gone = 0
    pending = set(tasks)
    try:
        while pending and not answers:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                exc = t.exception()
                if exc is None:
                    answers.append(t.result())
                    continue
                log.info("state donor %s failed: %r", tasks[t].endpoint, exc)
                gone += isinstance(exc, ControlError) and exc.kind in (NOT_FOUND,
                                                                       FAILED_PRECONDITION)
        if answers and pending:
            done, pending = await asyncio.wait(pending, timeout=HEADER_AGREE_WAIT)
            answers += [t.result() for t in done if t.exception() is None]
    finally:
        for t in pending:
            t.cancel()
    return answers, gone


def agreed(answers: list[Answer]) -> list[Answer] | None:
    """The holders that sent one header (the same digests, so the same bytes), the most of
    them, if at least two did; None where every holder's state differs."""
    groups: dict[tuple[bytes, int], list[Answer]] = {}
    for answer in answers:
        groups.setdefault((answer[2], answer[0].total), []).append(answer)
    best = max(groups.values(), key=len)
    return best if len(best) >= 2 else None


async def _first(pool: ControlClient, donor: Donor, request: pb.StateRequest,
                 timeout: float) -> pb.StateChunk:
    call = pool.download(donor.endpoint, request, timeout)
    try:
        async for chunk in call:
            if len(chunk.header) > MAX_HEADER:
                raise ValueError("state header too large")
            return chunk
    finally:
        call.cancel()
    raise ValueError("donor sent nothing")
