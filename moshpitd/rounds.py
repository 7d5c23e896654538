"""What one averaging request asks and gets, and the record each round leaves behind
(the IPC reply, `moshpit rounds`, metrics and one INFO log line per round)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field

from moshpitd import timebase
from moshpitd.allreduce.layout import TensorSpec
from moshpitd.matchmaking.grid import Grid
from moshpitd.metrics import Metrics

log = logging.getLogger("moshpitd.node")


class DataReady:
    """Whether a pending request's tensors are in its buffer: `ready` came (in, or abandoned
    by a trainer whose copy failed, so nothing of the buffer may be sent)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.abandoned = False

    def arrive(self, abandoned: bool) -> None:
        self.abandoned = abandoned
        self.event.set()


@dataclass(frozen=True)
class AverageRequest:
    key: str
    specs: tuple[TensorSpec, ...]
    weight: float = 1.0
    timeout: float = 30.0
    group_size: int = 16
    min_group_size: int = 2
    grid: Grid | None = None
    rounds: int = 1
    initial_coords: tuple[int, ...] | None = None
    codec: str = "none"
    aggregation: str = "mean"  # or trimmed_mean, centered_clip (moshpitd/allreduce/robust.py)
    local_world: int | None = None  # one of this host's local trainers (moshpitd/local/)
    local_rank: int | None = None  # its shard's rank; None: a replica
    rank_digests: bytes = b""  # a shard host's, for matchmaking (declaration.rank_digests)
    # set once the trainer's tensors are in the buffer; None: they were when it asked
    ready: DataReady | None = field(default=None, compare=False)


@dataclass(frozen=True)
class AverageResult:
    rounds: tuple[RoundRecord, ...]
    coords: tuple[int, ...] | None
    last_round: int | None
    spans: tuple[tuple[int, int, int], ...] = ()  # of the last all-reduce: start, stop, mask
    members: tuple[str, ...] = ()  # peer ids of the last group, in mask bit order
    owned: int = 0  # elements this peer reduced in the last all-reduce
    local_rank: int | None = None  # a local trainer's rank (a replica's order of arrival)
    local_ranks: tuple[int, ...] = ()  # the local trainers the host's contribution holds

    @property
    def last(self) -> RoundRecord:
        return self.rounds[-1]


@dataclass(frozen=True)
class RoundRecord:
    key: str
    group_size: int
    bytes_sent: int
    bytes_received: int
    seconds: float
    matchmaking_seconds: float
    result: str
    finished: float = field(default_factory=timebase.wall)


class RoundLog:
    def __init__(self, metrics: Metrics, keep: int = 100) -> None:
        self.metrics = metrics
        self.recent: deque[RoundRecord] = deque(maxlen=keep)
        self.done = 0
        self.failed = 0

    def record(self, key: str, size: int, sent: int, received: int, start: float,
                assembled: float, result: str, codec: str = "none",
                excluded: dict[str, int] | None = None) -> RoundRecord:
        now = timebase.monotonic()
        rec = RoundRecord(key, size, sent, received, now - start, assembled - start, result)
        self.recent.append(rec)
        self.metrics.rounds.labels(result).inc()
        self.metrics.round_duration.observe(now - start)
        self.metrics.observe_round(codec, sent, received, excluded)
        if result in ("ok", "alone", "skipped"):  # skipped: the group's weights were all 0
            self.done += 1
        else:
            self.failed += 1
        log.info("round key=%s group=%d sent=%d received=%d seconds=%.3f matchmaking=%.3f "
                 "result=%s", key, size, sent, received, now - start, assembled - start, result,
                 extra={"key": key, "group_size": size, "bytes_sent": sent,
                        "bytes_received": received, "seconds": round(now - start, 6),
                        "matchmaking_seconds": round(assembled - start, 6), "result": result})
        return rec
