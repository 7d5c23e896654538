"""Trainers per host: which of its host's daemons a trainer talks to, and which swarm peer
it is part of.

A scenario's `trainers_per_host` = K starts K trainer processes on every host, all in the
host's cgroup (they share its CPU quota with its daemons) and on its one link:

- `moshpit-local`: one daemon per host. Its K trainers average through it with
  `local_world=K` (docs/trainer.md, "One daemon per host"): they meet in the daemon's shared
  memory and the host is one peer of the swarm, so there are H peers.
- `moshpit-each`: K daemons per host, one per trainer, each its own peer: H x K peers. A
  host's daemons share its address, each on its own ports (`daemon_ports`).
- Every other system: one trainer per host, one daemon if it uses one (K must be 1).

Both moshpit rows then use Moshpit SGD's rule for their peers (bench/swarm/systems/
moshpit_sgd.py): the square grid for the peer count, peer i in cell (i mod M, i div M).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.swarm.systems import DAEMON_SYSTEMS, MULTI_TRAINER_SYSTEMS
from netlab.topology import DATA_PORT, DHT_PORT, GRPC_PORT

FIRST_PORTS = (DHT_PORT, GRPC_PORT, DATA_PORT)  # a host's first daemon (and its bootstrap)
MORE_PORTS_BASE = 7720  # its next daemons: 7720.., clear of the worker's 7710..7719
DAEMON_PER_TRAINER = frozenset({"moshpit-each"})
LOCAL_GROUPS = frozenset({"moshpit-local"})  # pass local_world, even with one trainer


def daemon_ports(index: int) -> tuple[int, int, int]:
    """(DHT, gRPC, data) ports of a host's `index`-th daemon."""
    if index == 0:
        return FIRST_PORTS
    base = MORE_PORTS_BASE + 3 * (index - 1)
    return (base, base + 1, base + 2)


@dataclass(frozen=True)
class Layout:
    system: str
    hosts: int
    trainers: int = 1  # per host

    def __post_init__(self) -> None:
        if self.trainers > 1 and self.system not in MULTI_TRAINER_SYSTEMS:
            raise ValueError(f"{self.system} runs one trainer per host; with "
                             f"{self.trainers} per host only {', '.join(MULTI_TRAINER_SYSTEMS)}"
                             " run")
        if self.trainers < 1 or self.hosts < 1:
            raise ValueError(f"need hosts >= 1 and trainers >= 1, not {self.hosts}, "
                             f"{self.trainers}")

    @property
    def per_trainer(self) -> bool:
        return self.system in DAEMON_PER_TRAINER

    @property
    def daemons_per_host(self) -> int:
        if self.system not in DAEMON_SYSTEMS:
            return 0
        return self.trainers if self.per_trainer else 1

    @property
    def peers_per_host(self) -> int:
        return self.trainers if self.per_trainer else 1

    @property
    def peers(self) -> int:
        return self.hosts * self.peers_per_host

    @property
    def local_world(self) -> int | None:
        """What the trainers pass as local_world: None where they do not form local groups."""
        return self.trainers if self.system in LOCAL_GROUPS else None

    def daemon(self, trainer: int) -> int:
        """The index, among its host's daemons, of the daemon `trainer` talks to."""
        return trainer if self.per_trainer else 0

    def peer(self, host: int, trainer: int) -> int:
        return host * self.trainers + trainer if self.per_trainer else host

    def knobs(self, host: int, trainer: int, hosts_at_end: int) -> dict[str, Any]:
        """What a daemon system's worker needs: its peer, the peer count, local_world and
        the final sync's group (the peers of the hosts alive at the end)."""
        return {"peers": self.peers, "peer": self.peer(host, trainer),
                "local_world": self.local_world,
                "final_group": hosts_at_end * self.peers_per_host}
