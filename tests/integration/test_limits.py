"""Each limit is a setting, and going over it gives an error that names the setting."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

import moshpit
from bench.attacks.dht_wire import RawDHT, hostport
from moshpitd.identity import PeerKey
from moshpitd.launcher import start_daemon


def test_limits_refuse_with_the_setting_named(tmp_path: Path) -> None:
    d = start_daemon("lim", tmp_path, extra_args=[
        "--max-request-bytes", "4000", "--max-group-size", "4", "--max-ipc-sessions", "2",
        "--max-message-bytes", "1048576", "--dht-max-value-bytes", "256",
        "--dht-max-records-per-key", "2"])
    try:
        with moshpit.Client(d.socket) as c:
            with pytest.raises(moshpit.InvalidRequest, match="max_request_bytes"):
                c.average([torch.zeros(1001)], key="big", group_size=2, timeout=2)
            with pytest.raises(moshpit.InvalidRequest, match="max_group_size"):
                c.average([torch.zeros(10)], key="many", group_size=8, timeout=2)
            with moshpit.Client(d.socket), pytest.raises(moshpit.DaemonUnavailable,
                                                         match="max_ipc_sessions"):
                moshpit.Client(d.socket)
            assert c.status()["status"]["rounds_done"] == 0  # the session goes on

        writers = [PeerKey.generate() for _ in range(4)]
        with RawDHT() as raw:
            def store(writer: PeerKey, value: bytes) -> object:
                return raw.store_sub(hostport(d.info["dht"]), "limits", writer, value)

            assert store(writers[0], b"x" * 256) is True
            assert store(writers[1], b"x" * 257) is False  # dht_max_value_bytes
            assert store(writers[2], b"x") is True
            # dht_max_records_per_key: a full key takes a new writer in place of the record
            # stored there longest ago, and never holds more
            assert store(writers[3], b"x") is True
            held = raw.find_subs(hostport(d.info["dht"]), "limits")
            assert sorted(r[0] for r in held) == sorted([writers[2].peer_id,
                                                         writers[3].peer_id]), held

        with grpc.insecure_channel(d.info["grpc"]) as channel:
            join = channel.unary_stream("/moshpit.Averager/Join",
                                        request_serializer=lambda b: b,
                                        response_deserializer=lambda b: b)
            with pytest.raises(grpc.RpcError) as info:
                list(join(b"\x0a" + b"\x80\x80\x80\x01" + b"k" * (2 << 20), timeout=5))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert d.alive()
    finally:
        d.stop()


def test_one_part_in_flight_still_gives_the_exact_mean(tmp_path: Path) -> None:
    """max_parts_in_flight=1: each sender waits for every answer before its next part (the
    strictest window) and the round still completes with the exact mean."""
    from moshpitd.launcher import LocalSwarm
    from tests.integration.helpers import run_parallel

    with LocalSwarm(3, workdir=tmp_path, extra_args=["--max-parts-in-flight", "1",
                                                     "--part-size", "4096"]) as swarm:
        def one(i: int) -> torch.Tensor:
            with moshpit.Client(swarm.sockets[i]) as c:
                (out,) = c.average([torch.arange(30_000, dtype=torch.float64) + 3 * i],
                                   key="window", group_size=3, timeout=20)
                return out
        results = run_parallel([lambda i=i: one(i) for i in range(3)])  # type: ignore[misc]
    want = torch.arange(30_000, dtype=torch.float64) + 3.0
    for r in results:
        assert isinstance(r, torch.Tensor) and torch.equal(r, want), r


def test_daemons_with_another_part_size_do_not_group(tmp_path: Path) -> None:
    """Every member cuts the vector into parts itself, so part_size is part of the schema: a
    daemon configured differently is told so instead of wrecking the round."""
    from moshpitd.launcher import start_daemon as start
    from tests.integration.helpers import run_parallel

    a = start("a", tmp_path, extra_args=["--part-size", "65536"])
    b = start("b", tmp_path, [a.dht], extra_args=["--part-size", "131072"])
    try:
        def one(sock: str) -> object:
            with moshpit.Client(sock) as c:
                return c.average([torch.zeros(100_000)], key="ps", group_size=2, timeout=3)
        results = run_parallel([lambda: one(a.socket), lambda: one(b.socket)])
        assert all(isinstance(r, moshpit.SchemaMismatch) for r in results), results
        assert "part_size" in str(results[0])
    finally:
        a.stop()
        b.stop()
