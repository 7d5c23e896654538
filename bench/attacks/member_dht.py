"""The mix's attacks by a swarm member on the DHT: it holds the swarm key, so its datagrams
are authentic, and it can make as many identities as it likes, each signing its own records.

- sealed-flood: one-byte datagrams with valid tags, dated 4.5 s ahead (each nonce is kept as
  long as the replay window allows), from SOURCES ports, at one daemon per slot: a sender's
  share of the replay cache is per address and port, and one machine has many ports
- run-records: run-directory entries with absurd rounds (0 in a cell off every line; joining
  at 2^61), each from a throw-away identity, under the soak key's run directory
- declarations: declarations under the soak's key with its schema, each from a throw-away
  identity, dated back so they rank before every honest peer, pointing at the attacker's
  tarpit (it accepts and never answers) or at a port where nothing listens
"""

from __future__ import annotations

import os
import socket
import struct
import time

from bench.attacks.dht_wire import RawDHT, hostport
from bench.attacks.mix import BURST_SECONDS, Attack, Env
from bench.attacks.targets import Swarm
from moshpitd.identity import PeerKey
from moshpitd.matchmaking.declaration import Declaration
from moshpitd.matchmaking.grid import Grid
from moshpitd.matchmaking.runs import PeerEntry

AHEAD = 4.5  # s a sealed message may be dated ahead of the receiver's clock (FUTURE_SKEW 5 s)


class SealedFlood(Attack):
    name = "sealed-flood"
    needs_key = True
    SOURCES = 32

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        self.socks = []
        for _ in range(self.SOURCES):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind((env.source, 0))
            self.socks.append(s)
        self.victim: str | None = None

    def step(self, swarm: Swarm) -> None:
        assert self.env.key is not None
        dhts = sorted(t.dht for t in swarm.targets)
        if self.victim not in dhts:  # one daemon a slot (or until it is killed)
            self.victim = self.env.rng.choice(dhts) if dhts else None
            self.counts["daemons flooded"] += 1
        if self.victim is None:
            return
        addr, tag = hostport(self.victim), self.env.key._tag
        until, i = time.monotonic() + BURST_SECONDS, 0
        while time.monotonic() < until:
            dated = struct.pack(">Q", int((time.time() + AHEAD) * 1000))
            for _ in range(64):
                i += 1
                head = dated + os.urandom(12)
                try:
                    self.socks[i % self.SOURCES].sendto(
                        head + b"x" + tag(b"dht", b"dht", head, b"x"), addr)
                except OSError:
                    self.counts["send errors"] += 1
                    continue
                self.counts["datagrams"] += 1

    def stop(self) -> None:
        self.victim = None
        super().stop()


class _Records(Attack):
    """Signed records from throw-away identities, sent without waiting; answers counted."""

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        self.raw = RawDHT(env.key, host=env.source)
        self.raw.sock.setblocking(False)

    def records(self, swarm: Swarm) -> list[tuple[str, bytes, int, float]]:
        """(key, value, version, ttl) of the next few records."""
        raise NotImplementedError

    def step(self, swarm: Swarm) -> None:
        addrs = [hostport(t.dht) for t in swarm.targets]
        until = time.monotonic() + BURST_SECONDS
        while addrs and time.monotonic() < until:
            for key, value, version, ttl in self.records(swarm):
                writer = PeerKey.generate()
                addr = addrs[self.counts["records"] % len(addrs)]
                try:
                    self.raw.store_sub(addr, key, writer, value, version, ttl, send_only=True)
                except OSError:
                    self.counts["send errors"] += 1
                    continue
                self.counts["records"] += 1
            self._answers()

    def _answers(self) -> None:
        """Read what came back: the daemons' answers, and their own requests to us."""
        while True:
            try:
                data = self.raw.sock.recv(1 << 16)
            except (BlockingIOError, OSError):
                return
            try:
                assert self.raw.key is not None
                data = self.raw.key.open(b"dht", b"dht", data)
            except Exception:
                continue
            if data[:1] == b"\x01":
                self.counts["answers"] += 1
                # a store's answer: True (taken) or False; anything else, a lookup's
                if data[21:22] == b"\xc3":
                    self.counts["taken"] += 1
                elif data[21:22] == b"\xc2":
                    self.counts["refused"] += 1
            else:
                self.counts["requests from daemons (never answered)"] += 1


class RunRecords(_Records):
    name = "run-records"
    needs_key = True
    GRID = Grid(4, 2)

    def records(self, swarm: Swarm) -> list[tuple[str, bytes, int, float]]:
        key, now = f"{swarm.key}/peers", time.time_ns()
        return [(key, PeerEntry(self.GRID, (1, 1), 0).pack(), now, 600.0),
                (key, PeerEntry(self.GRID, (2, 2), 1 << 61, joining=True).pack(), now, 600.0)]


class Declarations(_Records):
    name = "declarations"
    needs_key = True
    DATED_BACK = 5.0  # s: ranks before any peer that declared since

    def records(self, swarm: Swarm) -> list[tuple[str, bytes, int, float]]:
        if not self.env.tarpit:
            self.env.start_tarpit()
        version = time.time_ns() - int(self.DATED_BACK * 1e9)
        nowhere = "127.0.0.1:9"
        return [(swarm.key, Declaration(where, swarm.schema, data_endpoint=where).pack(),
                 version, 60.0) for where in (self.env.tarpit, nowhere)]
