"""Swarm key and TLS between real daemons: peers with the key average; a daemon without it
cannot read or store DHT records, join a group or open a data-plane stream; replays are dropped;
mutual TLS keeps out a daemon whose certificate comes from another CA."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import struct
import subprocess
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
import umsgpack

import moshpit
from moshpitd.auth import SwarmKey
from moshpitd.launcher import LocalSwarm, start_daemon
from moshpitd.proto import moshpit_pb2 as pb
from tests.integration.helpers import run_parallel, wait_until


def key_file(path: Path, secret: bytes) -> str:
    path.write_bytes(secret.hex().encode() + b"\n")
    path.chmod(0o600)
    return str(path)


def average_pair(sockets: list[str], key: str, timeout: float = 10.0) -> list[object]:
    def one(i: int) -> object:
        with moshpit.Client(sockets[i]) as c:
            (out,) = c.average([torch.full((50_000,), float(4 * i))], key=key, group_size=2,
                               timeout=timeout)
            return out
    return run_parallel([lambda i=i: one(i) for i in range(len(sockets))])  # type: ignore[misc]


def hostport(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


def rejected_dht(metrics: str) -> float:
    """DHT datagrams the daemon serving these metrics refused for their swarm-key tag, and
    those its kernel filter dropped as not sealed at all (dht/sieve.py)."""
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5) as resp:
        body = resp.read().decode()
    total = 0.0
    for pattern in (r'^moshpitd_auth_rejected_total\{plane="dht"\} (\S+)$',
                    r'^moshpitd_dht_rpcs_total\{direction="received",rpc="any",'
                    r'result="dropped_by_kernel"\} (\S+)$'):
        found = re.search(pattern, body, re.M)
        total += float(found.group(1)) if found else 0.0
    return total


def udp_ask(addr: tuple[str, int], datagram: bytes, wait: float = 1.0) -> bytes | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(wait)
        s.sendto(datagram, addr)
        try:
            return s.recv(65536)
        except TimeoutError:
            return None


def test_swarm_key_admits_members_only(tmp_path: Path) -> None:
    secret = os.urandom(32)
    members = ["--swarm-key-file", key_file(tmp_path / "swarm.key", secret)]
    with LocalSwarm(2, workdir=tmp_path / "s", extra_args=members) as swarm:
        results = average_pair(swarm.sockets, "members")
        assert all(isinstance(r, torch.Tensor) and torch.equal(r, torch.full((50_000,), 2.0))
                   for r in results), results
        a = swarm.daemons[0]
        refused = rejected_dht(a.info["metrics"])
        # a daemon with another key (and one with none) bootstrapped from a member: no DHT
        # contact, no group with the members
        outsiders = [
            start_daemon("other", tmp_path, [a.dht], extra_args=[
                "--swarm-key-file", key_file(tmp_path / "other.key", os.urandom(32))]),
            start_daemon("nokey", tmp_path, [a.dht]),
        ]
        try:
            # both tried to join through `a` and, still alone, tried again (0.5 s later):
            # `a` refused all of it
            wait_until(lambda: rejected_dht(a.info["metrics"]) >= refused + 4, 15,
                       "the member refusing the outsiders' joins and their retries")
            for d in outsiders:
                with moshpit.Client(d.socket) as c:
                    assert c.status()["status"]["dht_peers"] == 0
            mixed = average_pair([a.socket, outsiders[0].socket], "mixed", timeout=3.0)
            assert all(isinstance(r, moshpit.GroupNotFound) for r in mixed), mixed
            mixed = average_pair([swarm.daemons[1].socket, outsiders[1].socket], "mixed2",
                                 timeout=3.0)
            assert all(isinstance(r, moshpit.GroupNotFound) for r in mixed), mixed
        finally:
            for d in outsiders:
                d.stop()

        dht = hostport(a.dht)
        key = SwarmKey(secret.hex().encode())
        ping = b"\x00" + os.urandom(20) + umsgpack.packb(["ping", [os.urandom(20)]])
        # unsealed: no answer; sealed: an answer; the same sealed datagram again: dropped
        assert udp_ask(dht, ping) is None
        sealed = key.seal(b"dht", b"dht", ping)
        reply = udp_ask(dht, sealed)
        assert reply is not None and key.open(b"dht", b"dht", reply)[:1] == b"\x01"
        assert udp_ask(dht, sealed) is None
        # a record stored without the key is not stored
        store = b"\x00" + os.urandom(20) + umsgpack.packb(
            ["store_sub", [os.urandom(20), b"\x07" * 20, b"sk", b"forged", 1, 60.0]])
        assert udp_ask(dht, store) is None
        # gRPC: an unsealed Join never reaches the matchmaker
        with grpc.insecure_channel(a.info["grpc"]) as channel:
            join = channel.unary_stream("/moshpit.Averager/Join",
                                        request_serializer=pb.JoinRequest.SerializeToString,
                                        response_deserializer=pb.JoinResponse.FromString)
            with pytest.raises(grpc.RpcError) as info:
                list(join(pb.JoinRequest(group_key="members"), timeout=5))
            assert info.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
        # data plane: an unsealed HELLO closes the stream
        with socket.create_connection(hostport(a.info["data"]), timeout=5) as s:
            s.sendall(struct.pack("<BBHIQQ", 1, 0, 0, 0, 16, 0) + os.urandom(16))
            s.settimeout(5)
            with contextlib.suppress(ConnectionResetError):
                while s.recv(4096):  # an ABORT frame at most, then the daemon closes it
                    pass
        # still fine for members afterwards
        results = average_pair(swarm.sockets, "members-again")
        assert all(isinstance(r, torch.Tensor) for r in results), results
        # every refusal is counted, by plane
        import urllib.request
        with urllib.request.urlopen(f"http://{a.info['metrics']}/metrics", timeout=5) as r:
            text = r.read().decode()
        counts = {plane: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  for plane in ("dht", "grpc", "data")
                  if line.startswith(f'moshpitd_auth_rejected_total{{plane="{plane}"}}')}
        assert counts["grpc"] >= 1 and counts["data"] >= 1 and counts["dht"] >= 2, counts
    # counted, not logged as errors: anyone can send these
    assert "Traceback" not in a.log_path.read_text()


def test_swarm_key_file_problems_stop_the_daemon_at_start(tmp_path: Path) -> None:
    import sys
    weak = tmp_path / "weak.key"
    weak.write_bytes(b"short")
    weak.chmod(0o600)
    loose = tmp_path / "loose.key"
    loose.write_bytes(os.urandom(32).hex().encode())
    loose.chmod(0o644)
    for path, words in ((weak, "at least 16 bytes"), (loose, "readable or writable by others"),
                        (tmp_path / "missing.key", "cannot read swarm key file")):
        out = subprocess.run([sys.executable, "-m", "moshpitd", "--check-config",
                              "--swarm-key-file", str(path)], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2 and words in out.stderr, out.stderr
    out = subprocess.run([sys.executable, "-m", "moshpitd", "--check-config", "--tls-cert", "x"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "tls_key" in out.stderr


def make_ca(directory: Path, name: str) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_crt = directory / "ca.key", directory / "ca.crt"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2", "-subj",
                    f"/CN={name}", "-keyout", str(ca_key), "-out", str(ca_crt)],
                   check=True, capture_output=True)
    return ca_key, ca_crt


def make_cert(directory: Path, ca: tuple[Path, Path], name: str) -> list[str]:
    key, csr, crt = directory / f"{name}.key", directory / f"{name}.csr", directory / f"{name}.crt"
    ext = directory / f"{name}.ext"
    ext.write_text("subjectAltName=DNS:moshpitd,IP:127.0.0.1\n")
    subprocess.run(["openssl", "req", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-subj", f"/CN={name}",
                    "-keyout", str(key), "-out", str(csr)], check=True, capture_output=True)
    subprocess.run(["openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca[1]), "-CAkey",
                    str(ca[0]), "-CAcreateserial", "-days", "2", "-extfile", str(ext),
                    "-out", str(crt)], check=True, capture_output=True)
    return ["--tls-cert", str(crt), "--tls-key", str(key), "--tls-ca", str(ca[1])]


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed (needed to "
                    "generate test certificates: apt-get install openssl)")
def test_mutual_tls_between_daemons(tmp_path: Path) -> None:
    ca = make_ca(tmp_path / "ca", "moshpit test CA")
    tls = make_cert(tmp_path / "ca", ca, "node")
    with LocalSwarm(2, workdir=tmp_path / "s", extra_args=tls) as swarm:
        results = average_pair(swarm.sockets, "tls")
        assert all(isinstance(r, torch.Tensor) and torch.equal(r, torch.full((50_000,), 2.0))
                   for r in results), results
        a = swarm.daemons[0]
        # plaintext gRPC to a TLS port fails
        with grpc.insecure_channel(a.info["grpc"]) as channel, \
                pytest.raises(grpc.FutureTimeoutError):
            grpc.channel_ready_future(channel).result(timeout=2)
        # a daemon whose certificate comes from another CA finds no group with the members
        rogue_ca = make_ca(tmp_path / "rogue", "rogue CA")
        rogue = start_daemon("rogue", tmp_path, [a.dht],
                             extra_args=make_cert(tmp_path / "rogue", rogue_ca, "rogue"))
        try:
            mixed = average_pair([a.socket, rogue.socket], "mixed", timeout=3.0)
            assert all(isinstance(r, moshpit.GroupNotFound) for r in mixed), mixed
        finally:
            rogue.stop()
