"""Fuzzing daemon 0's DHT node with hypothesis-generated datagrams (see tests/fuzz)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
import torch
import umsgpack
from hypothesis import given
from hypothesis import strategies as st
from kademlia.utils import digest

import moshpit
from moshpitd.launcher import LocalSwarm
from moshpitd.matchmaking.declaration import Declaration
from tests.fuzz.strategies import I64, blobs, dht_scalars, dht_values, endpoints, floats, ints
from tests.fuzz.target import (
    CHECK_SCHEMA,
    FUZZ,
    FUZZ_NODE_ID,
    LURE_KEY,
    LURE_SCHEMA,
    MAX_DATAGRAM,
    STATE_KEY,
    Target,
    check_key,
    find_subs,
    live_target,
)
from tests.integration.helpers import wait_until


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    yield from live_target(tmp_path_factory)


@dataclass(frozen=True)
class Ref:
    """A value known only when the case runs: a real peer id, the key of an upcoming check."""
    kind: str
    n: int = 0


RPC_NAMES = ["ping", "store", "find_node", "find_value", "store_sub", "find_subs", "leave",
             "stun"]
good_ids = st.one_of(st.builds(Ref, st.just("peer"), st.integers(0, 2)), st.just(FUZZ_NODE_ID),
                     st.binary(min_size=20, max_size=20))
good_keys = st.one_of(st.builds(Ref, st.just("check"), st.integers(0, 2)),
                      st.sampled_from([digest(LURE_KEY), digest(f"{STATE_KEY}/donors")]),
                      st.binary(min_size=20, max_size=20))
record_values = st.one_of(
    # a matchmaking declaration: [1, endpoint, schema hash, client mode]
    st.builds(lambda e, h, c: bytes(msgpack.packb([1, e, h, c])), endpoints, st.one_of(
        st.just(CHECK_SCHEMA), st.just(LURE_SCHEMA), st.binary(max_size=20)), st.booleans()),
    # a state donor: [endpoint, version, total], older than the real one (a joiner asks only
    # the donors of the newest version, so a newer record of a gone donor blocks downloads)
    st.builds(lambda e, v, n: bytes(msgpack.packb([e, v, n])), endpoints,
              st.integers(I64, 1 << 40), ints),
    st.just(b""), st.binary(max_size=64), st.builds(bytes, st.sampled_from([1024, 1025])))
# each rpc's arguments, well-typed (the daemon checks types, so most cases reach a handler)
RPC_ARGS: dict[str, list[st.SearchStrategy[Any]]] = {
    "ping": [good_ids],
    "store": [good_ids, good_keys, st.one_of(ints, floats, st.text(max_size=24), blobs)],
    "find_node": [good_ids, good_keys],
    "find_value": [good_ids, good_keys],
    # the subkey is a writer's peer id, and a record must carry its writer's signature: the
    # fuzzer has no peer's key, so every record it sends is refused after its checks
    "store_sub": [good_ids, good_keys, st.one_of(st.just(FUZZ_NODE_ID), st.binary(
        min_size=20, max_size=20), st.binary(max_size=70)),
                  record_values, st.one_of(st.integers(0, 1 << 62), ints),
                  st.one_of(st.floats(-1, 4000), floats, st.integers(-1, 5000)),
                  # the writer's proof: [signed ttl, public key, signature], never valid here
                  st.one_of(st.builds(lambda t, k, g: [t, k, g], st.one_of(
                      st.floats(-1, 4000), floats), st.binary(min_size=32, max_size=32),
                      st.binary(min_size=64, max_size=64)), st.lists(dht_scalars, max_size=4))],
    "find_subs": [good_ids, good_keys],
    "leave": [good_ids],
    "stun": [],
}
wrong_args = st.one_of(dht_scalars, dht_values, st.binary(max_size=40))


@st.composite
def rpc_call(draw: st.DrawFn, name: str) -> list[Any]:
    """[name, args]: well-typed args, then up to two replaced, one dropped or one added."""
    args = [draw(a) for a in RPC_ARGS[name]]
    if args:
        for i in draw(st.lists(st.integers(0, len(args) - 1), max_size=2, unique=True)):
            args[i] = draw(wrong_args)
    how = draw(st.sampled_from([0, 0, 0, 0, 0, 0, 1, 2]))
    if how == 1:
        args = args[:-1]
    elif how == 2:
        args.append(draw(wrong_args))
    return [name, args]


rpc_calls = st.one_of(
    *[rpc_call(n) for n in RPC_NAMES],
    *[rpc_call(n) for n in RPC_NAMES],
    st.tuples(st.one_of(st.sampled_from(RPC_NAMES), st.text(max_size=12), dht_scalars),
              st.one_of(st.lists(dht_values, max_size=7), dht_values)).map(list),
    dht_values)


@dataclass(frozen=True)
class DhtCase:
    kind: bytes  # b"\x00" request, b"\x01" response, b"" raw bytes
    msg_id: bytes
    body: Any


dht_cases = st.one_of(
    st.builds(DhtCase, st.just(b"\x00"), st.binary(min_size=20, max_size=20), rpc_calls),
    st.builds(DhtCase, st.just(b"\x00"), st.binary(min_size=20, max_size=20), rpc_calls),
    st.builds(DhtCase, st.just(b"\x00"), st.binary(max_size=24), rpc_calls),
    st.builds(DhtCase, st.just(b"\x01"), st.binary(min_size=20, max_size=20), dht_values),
    st.builds(DhtCase, st.just(b""), st.just(b""), st.binary(max_size=600)),
    st.builds(DhtCase, st.just(b""), st.just(b""), st.builds(
        lambda head, n: head + b"\x00" * n, st.sampled_from([b"\x00" * 21, b"\x00" * 21 + b"\xdc",
                                                              b"\x02", b""]),
        st.sampled_from([0, 1000, 65_000, 65_486]))),
)


class DhtFuzzer:
    def __init__(self, t: Target) -> None:
        self.t = t
        host, port = t.daemon.dht.rsplit(":", 1)
        self.addr = (host, int(port))
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.setblocking(False)
        self.peer_ids = [bytes.fromhex(d.info["peer_id"]) for d in t.swarm.daemons]
        self.replies = 0

    def resolve(self, value: Any) -> Any:
        if isinstance(value, Ref):
            if value.kind == "peer":
                return self.peer_ids[value.n]
            return digest(check_key(self.t.checks + 1 + value.n))
        if isinstance(value, list):
            return [self.resolve(v) for v in value]
        return value

    def datagram(self, case: DhtCase) -> bytes:
        if not case.kind:
            return bytes(case.body)[:MAX_DATAGRAM]
        try:
            body = umsgpack.packb(self.resolve(case.body))
        except Exception:  # beyond umsgpack: send the stand-in
            body = b"\xc1"
        return (case.kind + case.msg_id + body)[:MAX_DATAGRAM]

    def send(self, case: DhtCase) -> None:
        self.sock.sendto(self.datagram(case), self.addr)
        self.drain()

    def drain(self) -> list[bytes]:
        """Read what arrived; a reply must be well-formed."""
        got: list[bytes] = []
        while True:
            try:
                data, _ = self.sock.recvfrom(1 << 16)
            except BlockingIOError:
                return got
            assert data[:1] in (b"\x00", b"\x01") and len(data) >= 21, data[:64]
            umsgpack.unpackb(data[21:])
            if data[:1] == b"\x01":
                self.replies += 1
            got.append(data)

    def ping(self) -> None:
        """Every rpc handled so far (they run in order): the node answers a plain ping."""
        for _ in range(3):
            msg_id = os.urandom(20)
            self.sock.sendto(b"\x00" + msg_id + umsgpack.packb(["ping", [FUZZ_NODE_ID]]),
                             self.addr)
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                for data in self.drain():
                    if data[1:21] == msg_id:
                        assert umsgpack.unpackb(data[21:]) == self.peer_ids[0]
                        return
                time.sleep(0.002)
        raise AssertionError("daemon 0's DHT node stopped answering pings")

    def leave(self) -> None:
        """Say goodbye, as a departing peer would, for every contact daemon 0 keeps at our
        address. (Until dropped, such silent contacts make its next DHT lookups crawl through
        them at a second per RPC; the checks measure the daemon, not that wait.)"""
        with moshpit.Client(self.t.daemon.socket) as c:
            contacts = c.peers()["contacts"]
        ours = f"127.0.0.1:{self.sock.getsockname()[1]}"
        for contact in contacts:
            if contact["dht"] == ours:
                self.sock.sendto(b"\x00" + os.urandom(20) + umsgpack.packb(
                    ["leave", [bytes.fromhex(contact["peer_id"])]]), self.addr)
        self.ping()

    def close(self) -> None:
        self.sock.close()


def test_fuzz_dht(target: Target) -> None:
    fuzzer = DhtFuzzer(target)
    target.before_check = fuzzer.leave
    try:
        @FUZZ
        @given(case=dht_cases)
        def fuzz(case: DhtCase) -> None:
            fuzzer.send(case)
            if target.cases % 100 == 0:
                fuzzer.ping()
            target.after_case()

        fuzz()
        fuzzer.ping()
        target.stats["dht replies"] += fuzzer.replies
        target.check("after DHT fuzzing")
    finally:
        target.before_check = None
        fuzzer.close()


def test_declaration_visible_in_later_attempts(target: Target) -> None:
    """A peer still matchmaking after its first attempt (matchmaking_attempt_timeout, 5 s)
    is still declared in the DHT, not withdrawn. (The DHT fuzzing found it: a first attempt
    slowed down by silent contacts left two peers each seeing the other's tombstone until the
    timeout.)"""
    key = "fuzz-lonely"
    peer = target.swarm.daemons[1]
    with moshpit.Client(peer.socket) as c:
        def average_alone() -> None:
            with contextlib.suppress(moshpit.GroupNotFound):
                c.average([torch.ones(4)], key=key, timeout=8.0)

        def declaration() -> list[Any] | None:
            """Its record under the key, as another daemon's DHT node serves it."""
            subs = find_subs(target.swarm.daemons[2].dht, key)
            assert isinstance(subs, list), subs
            return next((r for r in subs if bytes(r[0]).hex() == peer.info["peer_id"]), None)

        def live(record: list[Any]) -> bool:
            """A declaration, not the withdrawn one an attempt leaves behind."""
            decl = Declaration.unpack(bytes(record[1]))
            return decl is not None and not decl.withdrawn

        lonely = threading.Thread(target=average_alone)
        lonely.start()
        try:
            first = wait_until(lambda: (r := declaration()) and live(r) and r, 5,
                               "its first declaration", poll=0.05)
            # the first attempt ends after 5 s with its withdrawn declaration; the second
            # declares again with a later version, which must outrank it while it matchmakes
            def redeclared() -> list[Any] | bool:
                r = declaration()
                if r is not None and r[2] > first[2] and live(r):
                    return r
                return not lonely.is_alive()  # it ended: stop looking

            later = wait_until(redeclared, 10, "a later declaration or the request's end",
                               poll=0.05)
            last = declaration()
        finally:
            lonely.join(20)
    assert later is not True, f"no live declaration after its first attempt (last: {last})"


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_new_contacts_cost_little_cpu(swarm_factory: Callable[..., LocalSwarm]) -> None:
    """600 store_sub datagrams, each from a new node id under a new key (as the DHT fuzzing
    sends), take the daemon well under a second of CPU (each costs more than the last now:
    1000 take 10 s, 4000 two minutes, all of it with the event loop blocked)."""
    swarm = swarm_factory(2)
    d0 = swarm.daemons[0]
    host, port = d0.dht.rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.settimeout(120)
        before = cpu_seconds(d0.proc.pid)
        for i in range(600):
            sock.sendto(b"\x00" + os.urandom(20) + umsgpack.packb(
                ["store_sub", [os.urandom(20), os.urandom(20), b"w", b"v", 1, 600.0,
                               [600.0, os.urandom(32), os.urandom(64)]]]),
                (host, int(port)))
            if i % 100 == 99:  # let it keep up: no datagram lost to a full socket buffer
                msg_id = os.urandom(20)
                sock.sendto(b"\x00" + msg_id + umsgpack.packb(["ping", [FUZZ_NODE_ID]]),
                            (host, int(port)))
                while sock.recv(1 << 16)[1:21] != msg_id:
                    pass
        used = cpu_seconds(d0.proc.pid) - before
    assert used < 1.0, f"daemon 0 spent {used:.1f} s of CPU on 600 datagrams"
