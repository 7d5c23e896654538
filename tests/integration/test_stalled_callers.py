"""Callers that hold a daemon's gRPC port without using it, against real daemons on loopback:
connections past a bound per address are cut at once, and calls whose caller never reads are
cancelled on the daemon's clock, so honest peers on the same address still average."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from moshpitd.launcher import LocalSwarm
from moshpitd.proto import moshpit_pb2 as pb
from moshpitd.transport.grpc_server import MAX_STREAMS_PER_CONNECTION
from tests.integration.h2_raw import ZeroWindowClient
from tests.integration.helpers import scrape, wait_until
from tests.integration.test_hostile import honest_round, rss

WRITE_TIMEOUT = 2.0
CALLS_PER_ADDRESS = 100
CONNECTIONS_PER_ADDRESS = 16


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    args = ["--grpc-write-timeout", str(WRITE_TIMEOUT),
            "--grpc-max-calls-per-address", str(CALLS_PER_ADDRESS),
            "--grpc-max-connections-per-address", str(CONNECTIONS_PER_ADDRESS)]
    with LocalSwarm(2, workdir=tmp_path_factory.mktemp("stalled"), extra_args=args) as s:
        yield s


def refused(swarm: LocalSwarm, limit: str) -> float:
    return scrape(swarm.daemons[0]).get(f'moshpitd_grpc_refused_total{{limit="{limit}"}}', 0.0)


def grpc_address(swarm: LocalSwarm) -> tuple[str, int]:
    host, _, port = swarm.daemons[0].info["grpc"].rpartition(":")
    return host, int(port)


def test_calls_whose_caller_never_reads_are_cancelled(swarm: LocalSwarm) -> None:
    """Once, a client advertising an HTTP/2 window of 0 held every join slot of every daemon
    with 48 connections, and the handlers stayed blocked in their writes for good. Now 192
    such calls from one address (12 connections of 16): those past its bound are refused, the
    rest are cancelled after the write timeout, and an honest round from the same address
    goes through."""
    before = rss(swarm)
    stalled_before = refused(swarm, "write_stalled")
    request = pb.JoinRequest(group_key="nobody-here", peer_id=os.urandom(20)).SerializeToString()
    clients = [ZeroWindowClient(grpc_address(swarm))
               for _ in range(192 // MAX_STREAMS_PER_CONNECTION)]
    try:
        for c in clients:
            for _ in range(MAX_STREAMS_PER_CONNECTION):
                c.call("/moshpit.Averager/Join", request)
        wait_until(lambda: refused(swarm, "rpcs_per_address") >= 192 - CALLS_PER_ADDRESS,
                   10, "calls past the per-address bound refused")
        # every call the daemon took is cancelled once its response waits WRITE_TIMEOUT
        wait_until(lambda: refused(swarm, "write_stalled") - stalled_before >= CALLS_PER_ADDRESS,
                   WRITE_TIMEOUT + 10, "stalled calls cancelled")
        honest_round(swarm, "after-stalled-calls")  # its joins fit the address's bound again
    finally:
        for c in clients:
            c.close()
    assert rss(swarm) - before < 64 << 20
    assert all(d.alive() for d in swarm.daemons)


def test_connections_past_the_per_address_bound_are_cut(swarm: LocalSwarm) -> None:
    cut_before = refused(swarm, "per_address")
    conns = [socket.create_connection(grpc_address(swarm), timeout=5)
             for _ in range(CONNECTIONS_PER_ADDRESS + 8)]
    try:
        wait_until(lambda: refused(swarm, "per_address") - cut_before >= 8, 10,
                   "connections past the bound cut")
        # the daemon's own peer also connects from 127.0.0.1: once these go, it averages
    finally:
        for s in conns:
            s.close()
    wait_until(lambda: scrape(swarm.daemons[0])["moshpitd_grpc_connections"] <= 2, 10,
               "closed connections leave the gate")
    honest_round(swarm, "after-connection-flood")
