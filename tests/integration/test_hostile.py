"""Strangers and members against real daemons on loopback: what a peer sends cannot make a
daemon hold memory or CPU without bound, and honest peers still average exactly afterwards."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch

import moshpit
from moshpitd.launcher import LocalSwarm
from tests.integration.helpers import assert_close_to_mean, run_parallel, scrape, wait_until


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    with LocalSwarm(2, workdir=tmp_path_factory.mktemp("hostile")) as s:
        yield s


def rss(swarm: LocalSwarm, i: int = 0) -> int:
    with open(f"/proc/{swarm.daemons[i].proc.pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def honest_round(swarm: LocalSwarm, key: str) -> None:
    inputs = [torch.randn(50_000, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    clients = [moshpit.Client(s) for s in swarm.sockets]
    try:
        results = run_parallel([
            lambda i=i: clients[i].average([inputs[i]], key=key, group_size=2, timeout=20)
            for i in range(2)])
        for r in results:
            assert not isinstance(r, BaseException), r
            assert_close_to_mean(r[0], inputs, [1.0, 1.0])
    finally:
        for c in clients:
            c.close()


def test_large_messages_from_a_stranger_are_refused_before_they_are_held(
        swarm: LocalSwarm) -> None:
    """Once: 93 streams of 64 MiB grew a daemon to 6 GiB. A request is refused from its length
    prefix now, so 24 streams of 8 MiB each add next to nothing; and the gate reads no more
    than grpc_receive_rate from the stranger's address, so most of them never get that far
    (their caller gives up first)."""
    before = rss(swarm)
    target = swarm.daemons[0].info["grpc"]
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 1 << 30)]) as ch:
        join = ch.unary_stream("/moshpit.Averager/Join", request_serializer=lambda b: b,
                               response_deserializer=lambda b: b)

        def send(_: int) -> str:
            try:
                list(join(b"\x0a" * (8 << 20), timeout=5))
                return "answered"
            except grpc.RpcError as exc:
                return exc.code().name
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(send, range(24)))
    # refused from its length prefix, or held back by the gate until the caller's deadline
    assert "RESOURCE_EXHAUSTED" in codes, codes
    assert set(codes) <= {"RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "UNAVAILABLE"}, codes
    assert scrape(swarm.daemons[0]).get('moshpitd_grpc_refused_total{limit="paced"}', 0) > 0
    assert swarm.daemons[0].alive()
    assert rss(swarm) - before < 48 << 20, (before >> 20, rss(swarm) >> 20)
    honest_round(swarm, "after-large")


def test_a_daemon_that_does_not_encrypt_is_told_at_once_and_stalls_nobody(
        tmp_path: Path) -> None:
    """Encryption is part of what peers match on: a daemon with data_encryption = off among
    encrypting ones gets SchemaMismatch within its matchmaking, and the others still form
    their group (before, it joined them and every round stalled to its deadline)."""
    secret = tmp_path / "swarm.key"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    off = {"MOSHPITD_DATA_ENCRYPTION": "off"}
    with LocalSwarm(3, workdir=tmp_path / "swarm", extra_args=["--swarm-key-file", str(secret)],
                    env_by_index={2: off}) as swarm:
        inputs = [torch.full((10_000,), float(i)) for i in range(3)]
        clients = [moshpit.Client(s) for s in swarm.sockets]

        def call(i: int) -> object:
            began = time.monotonic()
            try:
                out: object = clients[i].average([inputs[i]], key="enc", group_size=3,
                                                 min_group_size=2, timeout=8)
            except moshpit.MoshpitError as exc:
                out = exc
            return out, time.monotonic() - began
        results = run_parallel([lambda i=i: call(i) for i in range(3)])
        for c in clients:
            c.close()
    (a, _), (b, _), (odd, _) = results
    assert isinstance(odd, moshpit.SchemaMismatch), odd
    for r in (a, b):
        assert isinstance(r, list), r
        assert torch.allclose(r[0], torch.full((10_000,), 0.5))


def test_a_probe_needs_the_declared_peer_s_signature(swarm: LocalSwarm) -> None:
    """A declaration pointing at a live daemon's address once passed the liveness probe
    (rounds went from 0.73 to 4.85 s): now only the declared peer's signature over the
    prober's nonce does."""
    import asyncio

    from moshpitd.node import MoshpitNode
    from moshpitd.node_config import NodeConfig

    real = swarm.daemons[1].info
    made_up = os.urandom(20)

    async def probe() -> tuple[bool, bool, bool]:
        node = MoshpitNode(NodeConfig())
        try:
            return (await node._probe(real["grpc"], bytes.fromhex(real["peer_id"])),
                    await node._probe(real["grpc"], made_up),
                    await node._probe("127.0.0.1:1", made_up))
        finally:
            await node.pool.close()
    assert asyncio.run(probe()) == (True, False, False)


def test_two_run_records_cannot_hang_a_daemon(swarm: LocalSwarm) -> None:
    """Two grid-directory entries, one at round 0 in a cell off the victim's lines and one
    "joining" at round 2^61, once made the round planner count towards 2^61 on the event loop:
    the daemon stopped answering its trainers and /metrics. Now its round answers at once
    (alone: nobody honest shares its lines) and the daemon stays responsive."""
    from bench.attacks.dht_wire import RawDHT, hostport
    from moshpitd.identity import PeerKey
    from moshpitd.matchmaking.grid import Grid
    from moshpitd.matchmaking.runs import PeerEntry, line_key

    grid = Grid(4, 2)
    attack = [(PeerEntry(grid, (1, 1), 0), PeerKey.generate()),
              (PeerEntry(grid, (2, 2), 1 << 61, joining=True), PeerKey.generate())]
    with RawDHT() as raw:  # under both lines of the victim's cell, (0, 0)
        for d in swarm.daemons:
            for entry, writer in attack:
                for axis in range(grid.dims):
                    assert raw.store_sub(hostport(d.dht), line_key("hang-run", axis, (0, 0)),
                                         writer, entry.pack())
        raw.leave(hostport(swarm.daemons[0].dht))
    with moshpit.Client(swarm.sockets[0]) as c:
        began = time.monotonic()
        out = run_parallel([lambda: c.average([torch.ones(1000)], key="hang-run", grid=(4, 2),
                                              initial_coords=(0, 0), timeout=5)], timeout=20)
        assert not isinstance(out[0], BaseException), out
        assert time.monotonic() - began < 5
        assert c.status()["status"]["peer_id"] == swarm.daemons[0].info["peer_id"]
    assert swarm.daemons[0].alive()


def test_throw_away_declarations_neither_lead_nor_hold_honest_peers(swarm: LocalSwarm) -> None:
    """Attack 7, the cheaper stall: a key holder floods the honest key with declarations of
    throw-away identities, dated 5 s back so they rank before every honest peer, at a tarpit
    (it takes the connection and never answers) and at a closed port. Before, each honest peer
    asked them to lead one after the other, a second each, and their records pushed the honest
    ones out of the key. Now a peer follows and waits for declared peers only once they signed
    its probe, and proven writers keep their places in a full key: the honest round gives the
    exact mean within a few seconds while the flood goes on."""
    import socket
    import threading

    from bench.attacks.dht_wire import RawDHT, hostport
    from moshpitd.identity import PeerKey
    from moshpitd.matchmaking.declaration import Declaration

    key = "flooded"
    honest_round(swarm, key)  # the two prove each other; their withdrawn records name the schema
    tarpit = socket.create_server(("127.0.0.1", 0), backlog=1024)  # never accepts
    with socket.create_server(("127.0.0.1", 0)) as closed:  # a port where nothing listens
        fakes = [f"127.0.0.1:{s.getsockname()[1]}" for s in (tarpit, closed)]
    stop = threading.Event()
    sent = [0]
    with RawDHT() as raw:
        rows = raw.find_subs(hostport(swarm.daemons[0].dht), key)
        found = [Declaration.unpack(row[1]) for row in rows]
        schema = next(d.schema_hash for d in found if d is not None)
        raw.sock.setblocking(False)

        def flood() -> None:
            while not stop.is_set():
                version = time.time_ns() - 5_000_000_000
                for d in swarm.daemons:
                    for where in fakes:
                        value = Declaration(where, schema, data_endpoint=where).pack()
                        try:
                            raw.store_sub(hostport(d.dht), key, PeerKey.generate(), value,
                                          version, 60.0, send_only=True)
                            sent[0] += 1
                        except OSError:
                            pass
                stop.wait(0.004)  # about 1000 records a second to the two daemons

        attacker = threading.Thread(target=flood, daemon=True)
        attacker.start()
        try:
            # more than a key holds (256): the key is full of them
            wait_until(lambda: sent[0] >= 600, 30, "600 throw-away declarations sent")
            began = time.monotonic()
            honest_round(swarm, key)
            took = time.monotonic() - began
        finally:
            stop.set()
            attacker.join(5)
            tarpit.close()
    assert took < 5.0, took
    assert all(d.alive() for d in swarm.daemons)
