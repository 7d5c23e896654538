"""The mix's attacks by a swarm member on matchmaking and the data plane.

- fake-leader: a leader of its own under the soak's key, declared 10 s back (it ranks first),
  that accepts every follower and never assembles
- join-flood: one identity, declared under the key (endpoints where nothing listens), sends
  signed joins to every daemon, IN_FLIGHT at a time each; a join a leader accepts is held
  open, so the ghost may end up a member that never sends a byte
- hello-flood: data-plane streams to every daemon, each opened by a valid sealed and signed
  HELLO for a group nobody holds, kept open, twice as many as a daemon keeps waiting
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import socket
import time

from bench.attacks.dht_wire import RawDHT, hostport
from bench.attacks.hello import hello_stream
from bench.attacks.leader import FakeLeader
from bench.attacks.mix import BURST_SECONDS, Attack, Env, HeldConnections
from bench.attacks.targets import Swarm, Target
from moshpitd.allreduce.registry import MAX_STRANGERS
from moshpitd.identity import PeerKey
from moshpitd.matchmaking.declaration import Declaration
from moshpitd.matchmaking.leading import PROTOCOL_VERSION
from moshpitd.matchmaking.signing import PeerAuth
from moshpitd.proto import moshpit_pb2 as pb
from moshpitd.transport.control import ControlError
from moshpitd.transport.grpc_server import ChannelPool
from moshpitd.transport.security import Security

NOWHERE = "127.0.0.1:9"  # where nothing listens
DECLARE_EVERY = 5.0  # s between stores of a declaration on every daemon


class _Declared(Attack):
    """An attack with one identity declared under the soak's key on every daemon: on those
    that appeared since, and on all again every DECLARE_EVERY seconds."""

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        self.on: set[str] = set()
        self.at = 0.0

    def declaration(self, swarm: Swarm) -> tuple[PeerKey, bytes, int, float]:
        """(identity, declaration, version, ttl)."""
        raise NotImplementedError

    def declare(self, swarm: Swarm) -> None:
        dhts = {t.dht for t in swarm.targets}
        due = dhts if time.monotonic() - self.at > DECLARE_EVERY else dhts - self.on
        if not due:
            return
        self.at = time.monotonic() if due == dhts else self.at
        writer, value, version, ttl = self.declaration(swarm)
        with RawDHT(self.env.key, host=self.env.source) as raw:
            for dht in sorted(due):
                took = raw.store_sub(hostport(dht), swarm.key, writer, value, version, ttl,
                                     timeout=0.5)
                self.counts["declarations taken" if took else "declarations refused"] += 1
        self.on = dhts

    def stop(self) -> None:
        self.on, self.at = set(), 0.0
        super().stop()


class StallingLeader(_Declared):
    name = "fake-leader"
    needs_key = True

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        self.leader: FakeLeader | None = None

    def declaration(self, swarm: Swarm) -> tuple[PeerKey, bytes, int, float]:
        assert self.leader is not None
        return (self.leader.peer, self.leader.declaration().pack(), self.leader.declare_at(),
                600.0)

    def step(self, swarm: Swarm) -> None:
        assert self.env.key is not None
        if self.leader is None:  # a new identity each slot: never known for stalling
            self.leader = FakeLeader(self.env.loop, self.env.key, swarm.key, swarm.schema,
                                     elems=1, followers=1 << 30)
        self.declare(swarm)
        time.sleep(BURST_SECONDS)  # the followers come to it
        self.counts["followers held, at most"] = max(self.counts["followers held, at most"],
                                                     len(self.leader.joins))

    def stop(self) -> None:
        if self.leader is not None:
            self.counts["followers held"] += len(self.leader.joins)
            self.leader.close()
            self.leader = None
        super().stop()


class JoinFlood(_Declared):
    name = "join-flood"
    needs_key = True
    IN_FLIGHT = 32  # per daemon
    TIMEOUT = 10.0

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        self.ghost = PeerKey.generate()
        self.pool: ChannelPool | None = None
        self.running: dict[str, set[cf.Future[str]]] = {}

    def declaration(self, swarm: Swarm) -> tuple[PeerKey, bytes, int, float]:
        value = Declaration(NOWHERE, swarm.schema, data_endpoint=NOWHERE).pack()
        return self.ghost, value, time.time_ns(), 60.0

    async def _join(self, target: Target, via: str, key: str, schema: bytes) -> str:
        assert self.pool is not None
        request = PeerAuth(self.ghost).sign_join(pb.JoinRequest(
            group_key=key, peer_id=self.ghost.peer_id, endpoint=NOWHERE, schema_hash=schema,
            weight=1.0, protocol_version=PROTOCOL_VERSION, data_endpoint=NOWHERE,
            bandwidth=1.0, codec="none"), target.peer_id)
        call = self.pool.join(via, request, timeout=self.TIMEOUT)
        try:
            first = await call.read()
            if first is None:
                return "EOF"
            if first.code == pb.ACCEPTED:  # held open: a member that will never send
                last = first
                while (answer := await call.read()) is not None:
                    last = answer
                return f"ACCEPTED, then {pb.JoinCode.Name(last.code)}"
            return str(pb.JoinCode.Name(first.code))
        except ControlError as exc:
            return f"rpc {exc.kind}"
        finally:
            call.cancel()

    def step(self, swarm: Swarm) -> None:
        assert self.env.key is not None
        if self.pool is None:
            self.ghost = PeerKey.generate()
            self.pool = ChannelPool(security=Security(self.env.key))
        self.declare(swarm)
        self.env.egress.keep({t.grpc for t in swarm.targets})
        for target in swarm.targets:
            running = self.running.setdefault(target.grpc, set())
            via = self.env.egress.via(target.grpc)
            while len(running) < self.IN_FLIGHT:
                running.add(asyncio.run_coroutine_threadsafe(
                    self._join(target, via, swarm.key, swarm.schema), self.env.loop.loop))
                self.counts["joins"] += 1
        everything = set().union(*self.running.values())
        done, _ = cf.wait(everything, BURST_SECONDS, cf.FIRST_COMPLETED)
        for running in self.running.values():
            for f in running & done:
                running.discard(f)
                self.counts[f"answer {f.result()}"] += 1

    def stop(self) -> None:
        for running in self.running.values():
            for f in running:
                f.cancel()
        self.running.clear()
        if self.pool is not None:
            self.env.loop.run(self.pool.close())
            self.pool = None
        super().stop()


class HelloFlood(HeldConnections):
    name = "hello-flood"
    needs_key = True
    PER_DAEMON = 2 * MAX_STRANGERS

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        self.keys = (PeerKey.generate(), PeerKey.generate())

    def endpoint(self, target: Target) -> str:
        return target.data

    def connect(self, endpoint: str) -> socket.socket:
        assert self.env.key is not None
        s = hello_stream(endpoint, self.env.key, self.keys, timeout=1.0, source=self.env.source)
        s.setblocking(False)
        return s

    def alive(self, s: socket.socket) -> bool:
        return _open(s)


def _open(s: socket.socket) -> bool:
    """Whether the daemon still holds the stream (what it sent is read and dropped)."""
    try:
        while data := s.recv(1 << 16, socket.MSG_DONTWAIT):
            del data
        return False  # end of stream
    except BlockingIOError:
        return True
    except OSError:
        return False
