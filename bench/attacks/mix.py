"""What every attack of the rotating mix shares: the environment it runs in, and the shape of
an attack (one short burst of work per `step`, whatever it holds released by `stop`).

An attack runs flat out: it never sleeps to pace itself, so what bounds its rate is the CPU
quota of the cgroup the attacker runs in (bench/soak_attack.py gives it the burner's quota).
Each burst is short (tens of milliseconds), so the runner can switch attacks on time and read
the targets again between bursts."""

from __future__ import annotations

import asyncio
import random
import socket
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from typing import ClassVar

from bench.attacks.egress import Egress
from bench.attacks.loop import LoopThread
from bench.attacks.targets import Swarm, Target
from moshpitd.auth import SwarmKey

BURST_SECONDS = 0.05  # how long one step works before the runner looks at the clock again


@dataclass
class Env:
    """What the attacker has: the swarm key (None: a stranger), an event loop of its own, the
    address its connections leave from (`source`, and `egress` for gRPC channels), a tarpit
    (a TCP port that accepts and never answers), and its random source."""

    key: SwarmKey | None
    loop: LoopThread
    rng: random.Random
    source: str
    egress: Egress = field(init=False)
    tarpit: str = field(init=False, default="")
    _held: list[asyncio.StreamWriter] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.egress = Egress(self.loop, self.source)

    def start_tarpit(self) -> str:
        async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self._held.append(writer)
            while await reader.read(1 << 16):
                pass  # read and drop: the caller waits for an answer that never comes
            writer.close()
            self._held.remove(writer)

        server = self.loop.run(asyncio.start_server(hold, "127.0.0.1", 0))
        self.tarpit = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        return self.tarpit


class Attack(ABC):
    """One attack of the mix; `counts` says what it sent and what came back."""

    name: ClassVar[str]
    needs_key: ClassVar[bool]  # a swarm member's attack (else a stranger's)

    def __init__(self, env: Env) -> None:
        self.env = env
        self.counts: Counter[str] = Counter()

    @abstractmethod
    def step(self, swarm: Swarm) -> None:
        """About BURST_SECONDS of attack against the swarm's current daemons."""

    def stop(self) -> None:
        """The slot is over: close what is held (records in the DHT stay until their TTL).
        Subclasses that hold anything close it, then call this."""
        self.counts["slots"] += 1


class HeldConnections(Attack):
    """Up to PER_DAEMON connections to each daemon held open (OPEN_PER_STEP more a step), those
    the daemon closed replaced."""

    PER_DAEMON: ClassVar[int]
    OPEN_PER_STEP: ClassVar[int] = 16

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        self.held: dict[str, list[socket.socket]] = {}

    @abstractmethod
    def endpoint(self, target: Target) -> str:
        """Where the connections go."""

    @abstractmethod
    def connect(self, endpoint: str) -> socket.socket:
        """A new connection, its first bytes sent; OSError if it could not be made."""

    @abstractmethod
    def alive(self, s: socket.socket) -> bool:
        """Whether the daemon still holds `s`."""

    def step(self, swarm: Swarm) -> None:
        live = {self.endpoint(t) for t in swarm.targets}
        for gone in set(self.held) - live:
            for s in self.held.pop(gone):
                s.close()
        for endpoint in sorted(live):
            before = self.held.get(endpoint, [])
            held = [s for s in before if self.alive(s)]
            for s in set(before) - set(held):
                s.close()
                self.counts["connections closed by the daemon"] += 1
            for _ in range(min(self.OPEN_PER_STEP, self.PER_DAEMON - len(held))):
                try:
                    held.append(self.connect(endpoint))
                except OSError:
                    self.counts["connects refused"] += 1
                    break
                self.counts["connections"] += 1
            self.held[endpoint] = held
        self.counts["held at most"] = max(self.counts["held at most"],
                                          sum(map(len, self.held.values())))

    def stop(self) -> None:
        for held in self.held.values():
            for s in held:
                s.close()
        self.held.clear()
        super().stop()
