"""What a holder of the swarm key can no longer do on the channels between daemons, on real
daemons: speak on the data plane as another member, join a group under a peer id whose key it
lacks, fail a round by flooding HELLOs, or alter a frame on the way unnoticed.

Three daemons share the swarm key (so their streams are encrypted); the third is reached
through a relay that forwards its ports and can flip a byte on the way, as an on-path attacker.
The attackers (bench/attacks/) hold the swarm key and peer keys of their own. A test
passes when every honest trainer's result is correct by the masks it reports, and the attack
was refused or cut out; never because a round merely completed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
import torch

import moshpit
from bench.attacks.dht_wire import hostport
from bench.attacks.hello import hello_flood
from bench.attacks.leader import FakeLeader
from bench.attacks.loop import LoopThread, free_port
from bench.attacks.relay import Relay
from moshpitd.allreduce.layout import schema_hash, specs_from_wire
from moshpitd.allreduce.registry import MAX_STRANGERS
from moshpitd.allreduce.robust import aggregate
from moshpitd.auth import SwarmKey
from moshpitd.identity import PeerKey
from moshpitd.launcher import LocalSwarm, start_daemon
from moshpitd.matchmaking.leading import PROTOCOL_VERSION
from moshpitd.matchmaking.signing import PeerAuth
from moshpitd.proto import moshpit_pb2 as pb
from moshpitd.transport.grpc_server import JOIN
from moshpitd.transport.security import Security
from tests.integration.helpers import active_keys, run_parallel, scrape, wait_until
from tests.integration.test_grid import check_round
from tests.integration.test_identity_attacks import average_all, swarm_key

ELEMS = 20_000
ATTEMPT = 5.0  # s: matchmaking_attempt_timeout's default
# a fake leader's declaration that ends within an attempt of the followers' (a replica keeps
# a record for what its sender says is left, within its clock skew): what an honest peer's
# could be, so they follow it
IN_AN_ATTEMPT = ATTEMPT + 3.0
WAITING = "moshpitd_data_streams_waiting"


@dataclass
class Net:
    swarm: LocalSwarm
    key: SwarmKey
    loop: LoopThread
    relay: Relay

    @property
    def ids(self) -> list[str]:
        return [d.info["peer_id"] for d in self.swarm.daemons]


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Net]:
    tmp = tmp_path_factory.mktemp("channels")
    key, args = swarm_key(tmp)
    loop = LoopThread()
    swarm = LocalSwarm(2, workdir=tmp, extra_args=args).start()
    gport, dport = free_port("127.0.0.2"), free_port("127.0.0.2")
    relay = Relay(loop, "127.0.0.3", "127.0.0.2", [gport, dport], dport)
    try:  # d2 listens on 127.0.0.2 and tells its peers 127.0.0.3: the relay's address
        swarm.daemons.append(start_daemon(
            "d2", tmp, [swarm.daemons[0].dht], extra_args=[
                *args, "--grpc-listen", f"127.0.0.2:{gport}", "--data-port", str(dport),
                "--advertise-host", "127.0.0.3"]))
        assert swarm.daemons[2].info["data"] == f"127.0.0.3:{dport}"
        assert "streams encrypted" in swarm.daemons[2].log_path.read_text()
        yield Net(swarm, key, loop, relay)
    finally:
        swarm.stop()
        relay.close()
        loop.close()
    for d in swarm.daemons:  # nothing the attackers sent is an error of the daemon's
        assert "Traceback" not in d.log_path.read_text()


def inputs_of(ids: list[str], seed: int = 0) -> dict[str, torch.Tensor]:
    return {pid: torch.randn(ELEMS, generator=torch.Generator().manual_seed(seed + i))
            for i, pid in enumerate(ids)}


def join_call(endpoint: str, key: SwarmKey, request: pb.JoinRequest) -> pb.JoinResponse:
    """One Join to a daemon, sealed with the swarm key as members seal theirs: its first answer."""
    with grpc.insecure_channel(endpoint) as channel:
        call = channel.unary_stream(JOIN, **Security(key).client_side(JOIN, pb.JoinRequest,
                                                                      pb.JoinResponse))
        stream = call(request, timeout=5)
        try:
            return next(iter(stream))
        finally:
            stream.cancel()


def test_phantom_joins_are_refused(net: Net) -> None:
    """Attack 3, the identity part: joins under peer ids whose keys the attacker lacks (made
    up, or an honest peer's), or signed for another leader, are refused as UNAUTHENTICATED
    while d0 leads; the group then forms of the three honest peers alone."""
    d0, d1 = net.swarm.daemons[:2]
    schema = schema_hash(specs_from_wire([["float32", [ELEMS], 0]]), "none", encrypted=True,
                         checked=True)
    attacker = PeerKey.generate()

    def join(peer_id: bytes, leader: bytes | None = None) -> pb.JoinRequest:
        request = pb.JoinRequest(
            group_key="phantoms", peer_id=peer_id, endpoint="127.0.0.1:9",
            data_endpoint="127.0.0.1:9", schema_hash=schema, weight=1.0, bandwidth=1.0,
            protocol_version=PROTOCOL_VERSION, codec="none")
        return PeerAuth(attacker).sign_join(request, leader or bytes.fromhex(d0.info["peer_id"]))

    unsigned = join(os.urandom(20))
    unsigned.ClearField("signature")
    phantoms = {"made-up id, unsigned": unsigned,
                "made-up id, the attacker's key": join(os.urandom(20)),
                "d1's id, the attacker's key": join(bytes.fromhex(d1.info["peer_id"])),
                "its own id, signed for d1": join(attacker.peer_id, bytes.fromhex(
                    d1.info["peer_id"]))}
    inputs = inputs_of(net.ids)
    with ThreadPoolExecutor(3) as pool, moshpit.Client(d0.socket) as watch:
        def average(i: int) -> set[str]:
            with moshpit.Client(net.swarm.sockets[i]) as c:
                (out,) = c.average([inputs[net.ids[i]]], key="phantoms", group_size=3,
                                   timeout=20)
                return check_round(out, c.last_round, net.ids[i], inputs,
                                   dict.fromkeys(net.ids, 1.0))

        leading = pool.submit(average, 0)
        wait_until(lambda: "phantoms" in active_keys(watch), 10, "d0 matchmaking")
        answers = {}
        for what, request in phantoms.items():
            answers[what] = wait_until(  # d0 opens to followers just after it registers
                lambda r=request: (a := join_call(d0.info["grpc"], net.key, r)).code
                != pb.NOT_LOOKING and a, 5, f"d0 answering {what}")
        assert {w: pb.JoinCode.Name(a.code) for w, a in answers.items()} == dict.fromkeys(
            phantoms, "UNAUTHENTICATED"), answers
        groups = [pool.submit(average, i) for i in (1, 2)]
        assert [f.result(30) for f in (leading, *groups)] == [set(net.ids)] * 3
    assert scrape(d0)['moshpitd_auth_rejected_total{plane="join"}'] >= len(phantoms)


def test_impersonation_on_the_data_plane_is_refused(net: Net) -> None:
    """Attack 1: a key holder leads a group of the three honest peers (its declaration dated
    early), holds the GroupInfo back while it opens streams to every honest owner as every
    other member, then averages 1000.0 as itself. Before, honest owners took those streams and
    refused the real members, so every honest peer got ~501.5 under trimmed_mean, with masks
    saying all four contributed. Now each owner refuses the streams that do not prove their
    member's key, and every element is the trimmed mean of the four real contributions."""
    schema = schema_hash(specs_from_wire([["float32", [ELEMS], 0]]), "none", "trimmed_mean",
                         encrypted=True, checked=True)
    leader = FakeLeader(net.loop, net.key, "impersonate", schema, ELEMS, followers=3)
    try:
        leader.declare([d.dht for d in net.swarm.daemons], ttl=IN_AN_ATTEMPT)
        inputs = {**inputs_of(net.ids, 10),  # (its round averages into leader.values)
                  leader.peer.peer_id.hex(): torch.from_numpy(leader.values.copy())}
        with ThreadPoolExecutor(3) as pool:
            def average(i: int) -> tuple[torch.Tensor, moshpit.RoundInfo | None]:
                with moshpit.Client(net.swarm.sockets[i]) as c:
                    (out,) = c.average([inputs[net.ids[i]]], key="impersonate", group_size=4,
                                       aggregation="trimmed_mean", timeout=20)
                    return out, c.last_round

            calls = [pool.submit(average, i) for i in range(3)]
            for d in net.swarm.daemons:  # every owner holds two impostors' streams
                wait_until(lambda d=d: scrape(d)[WAITING] >= 2, 15, f"{d.name} holding them")
            leader.hand_out_group()
            results = [f.result(30) for f in calls]
        honest = np.stack([inputs[p].numpy() for p in net.ids])
        for out, info in results:
            assert info is not None and len(info.members) == 4
            for start, stop, mask in info.spans:
                assert mask == 0b1111, info.spans  # every real member, and nobody else
                rows = np.stack([inputs[p][start:stop].numpy().astype(np.float64)
                                 for p in info.members])
                want = aggregate("trimmed_mean", rows, np.ones(4))
                np.testing.assert_allclose(out[start:stop].numpy(), want, rtol=1e-6, atol=1e-6)
            got = out.numpy()  # robust aggregation holds: within the honest values' range
            assert (got >= honest.min(0) - 1e-6).all() and (got <= honest.max(0) + 1e-6).all()
        assert leader.outcome().parts_averaged > 0
        for d in net.swarm.daemons:
            m = scrape(d)
            assert m['moshpitd_data_streams_refused_total{reason="identity"}'] >= 2, m
            assert m['moshpitd_auth_rejected_total{plane="data_handshake"}'] >= 2, m
    finally:
        leader.close()


def test_a_tampered_frame_is_detected_and_its_sender_excluded(net: Net) -> None:
    """One byte flipped inside the first part that reaches d2 through the relay: d2 detects it
    (AES-GCM), refuses that part and excludes its sender for the rest of its span. Every
    result is the exact mean of the members its masks name; without authentication the
    altered value would have been averaged in, and the masks would not show it."""
    d2 = net.swarm.daemons[2]
    before = scrape(d2).get('moshpitd_excluded_parts_total{fault="tampered"}', 0.0)
    net.relay.tamper, net.relay.tampered_sender = True, None
    inputs = inputs_of(net.ids, 20)

    def average(i: int) -> moshpit.RoundInfo:
        with moshpit.Client(net.swarm.sockets[i]) as c:
            (out,) = c.average([inputs[net.ids[i]]], key="tamper", group_size=3, timeout=20)
            check_round(out, c.last_round, net.ids[i], inputs, dict.fromkeys(net.ids, 1.0))
            assert c.last_round is not None
            return c.last_round

    infos = run_parallel([lambda i=i: average(i) for i in range(3)])
    assert all(isinstance(i, moshpit.RoundInfo) for i in infos), infos
    sender = net.relay.tampered_sender
    assert sender is not None and not net.relay.tamper
    cut = infos[0].members[sender]
    assert cut != net.ids[2]  # a sender to d2
    full = (1 << 3) - 1
    for pid, info in zip(net.ids, infos, strict=True):
        masks = {mask for _, _, mask in info.spans}
        # d2's span: averaged without the sender, or (at the sender) its own values kept
        assert (0 if pid == cut else full & ~(1 << sender)) in masks, (pid, info.spans)
    assert scrape(d2)['moshpitd_excluded_parts_total{fault="tampered"}'] > before
    assert "tampered" in d2.log_path.read_text()


def test_a_hello_flood_fails_no_round(net: Net) -> None:
    """Attack 6: each daemon gets twice as many sealed, signed HELLOs for made-up groups as
    its table for unknown groups holds, kept open. Before, 1030 of them made the next real
    round fail with 'too many pending groups'. Now the flood's host holds its half of the
    table (the rest refused as busy), and rounds on all three daemons give the exact mean;
    the flood held its half all along."""
    socks = []
    share = MAX_STRANGERS // 2  # one host's (the flood comes from loopback, as the peers do)
    try:
        for d in net.swarm.daemons:
            socks += hello_flood(d.info["data"], net.key, 2 * MAX_STRANGERS)
        for d in net.swarm.daemons:
            wait_until(lambda d=d: scrape(d)[WAITING] == share and scrape(d)[
                'moshpitd_data_streams_refused_total{reason="busy"}'] >= MAX_STRANGERS, 10,
                f"{d.name}'s table filled")
        for key in ("after-flood", "after-flood-2"):
            average_all(net.swarm, key, ELEMS, group_size=3)
        for d in net.swarm.daemons:
            assert scrape(d)[WAITING] == share  # the flood held its half throughout
    finally:
        for s in socks:
            s.close()


def test_a_leader_that_accepts_and_never_assembles_holds_nobody_for_long(net: Net) -> None:
    """One identity declares itself 10 s back, so it ranks first, then answers ACCEPTED and
    nothing more. Followers once waited for the later of their own and its declared deadline,
    failing after their whole timeout. Declared for 600 s, it is no honest attempt's and
    nobody follows it or waits for it. Declared for one attempt, it holds each follower until
    the earlier of the two deadlines, is not asked again (in the next round either), and the
    honest peers average among themselves within their timeout."""
    schema = schema_hash(specs_from_wire([["float32", [ELEMS], 0]]), "none", encrypted=True,
                         checked=True)
    inputs = inputs_of(net.ids, 20)
    want = torch.stack([inputs[p] for p in net.ids]).mean(0)
    timeout = 25.0  # a loaded machine (the suite runs 5 workers) may need a third attempt

    def average(i: int, key: str) -> tuple[torch.Tensor, moshpit.RoundInfo | None, float]:
        with moshpit.Client(net.swarm.sockets[i]) as c:
            began = time.monotonic()
            (out,) = c.average([inputs[net.ids[i]]], key=key, group_size=4,
                               min_group_size=3, timeout=timeout)
            return out, c.last_round, time.monotonic() - began

    def rounds(key: str, leader: FakeLeader, ttl: float) -> list[float]:
        took_by_round = []
        for _ in range(2):
            leader.declare([d.dht for d in net.swarm.daemons], ttl=ttl)
            with ThreadPoolExecutor(3) as pool:
                results = [f.result(60) for f in
                           [pool.submit(average, i, key) for i in range(3)]]
            for out, info, took in results:
                assert info is not None and set(info.members) == set(net.ids), info
                assert torch.allclose(out, want, atol=1e-6), (out - want).abs().max()
                assert took < timeout, took
            took_by_round.append(max(r[2] for r in results))
        return took_by_round

    for key, ttl in (("stall-600", 600.0), ("stall", IN_AN_ATTEMPT)):
        leader = FakeLeader(net.loop, net.key, key, schema, ELEMS, followers=99)  # never full
        try:
            took_by_round = rounds(key, leader, ttl)
            if ttl > IN_AN_ATTEMPT:  # followed by nobody, in either round
                assert not leader.joins and max(took_by_round) < ATTEMPT, took_by_round
            else:
                # followed in the first round; the next does not ask that leader again (it
                # is shunned for a while over all requests), so it costs nobody an attempt
                assert leader.joins, "nobody followed the leader declared for one attempt"
                assert took_by_round[1] < took_by_round[0] / 2, took_by_round
        finally:
            leader.close()


def test_a_flood_of_sealed_datagrams_neither_freezes_nor_silences_a_daemon(net: Net) -> None:
    """A key holder sends 40,000 one-byte DHT datagrams, sealed and dated 4.5 s ahead, from one
    address. The replay cache once held 200k nonces for up to 60 s and, full, rebuilt itself on
    every message (the loop blocked 1.9 s at a time; the victim's rounds failed). Now each
    message costs constant time, one address may hold a sixteenth of the cache (the rest of
    its flood is refused), and the honest peers still average exactly."""
    import socket
    import struct

    d0 = net.swarm.daemons[0]
    before = scrape(d0)
    lag = "moshpitd_event_loop_lag_seconds"
    dated = int((time.time() + 4.5) * 1000)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for i in range(40_000):
            head = struct.pack(">Q", dated) + os.urandom(12)
            s.sendto(head + b"x" + net.key._tag(b"dht", b"dht", head, b"x"), hostport(d0.dht))
            if i % 500 == 499:
                time.sleep(0.002)  # as fast as the daemon reads, not faster than the kernel
    wait_until(lambda: scrape(d0)['moshpitd_auth_rejected_total{plane="dht"}']
               - before['moshpitd_auth_rejected_total{plane="dht"}'] >= 1, 10,
               "the flood refused beyond the sender's share")
    average_all(net.swarm, "after-flood")
    after = scrape(d0)
    samples = after[f"{lag}_count"] - before[f"{lag}_count"]
    slow = samples - (after[f'{lag}_bucket{{le="1.0"}}'] - before[f'{lag}_bucket{{le="1.0"}}'])
    assert samples > 0 and slow == 0, (samples, slow)  # the loop never stalled for 1 s
    assert d0.alive()


def test_a_group_listing_a_peer_that_never_joined_is_left(net: Net) -> None:
    """Attack 7's listed peer: a key holder leads the first of d0 and d1 to join it and lists
    d2 as a member too, as d2 declared itself under the key in the round before (its withdrawn
    declaration once vouched for it), though d2 never asked it to lead. The follower finds no
    join of d2's in the GroupInfo, leaves the group with a warning, and d0 and d1 average
    among themselves."""
    from bench.attacks.dht_wire import RawDHT, hostport
    from moshpitd.allreduce.group import GroupMember
    from moshpitd.matchmaking.declaration import Declaration

    key = "listed"
    average_all(net.swarm, key, ELEMS, group_size=3)  # d2's declaration is under the key now
    d2 = net.swarm.daemons[2]
    with RawDHT(net.key) as raw:
        rows = raw.find_subs(hostport(net.swarm.daemons[0].dht), key)
        raw.leave(hostport(net.swarm.daemons[0].dht))
    theirs = {r[0]: Declaration.unpack(r[1]) for r in rows}
    d2_decl = theirs[bytes.fromhex(d2.info["peer_id"])]
    assert d2_decl is not None and d2_decl.withdrawn
    schema = schema_hash(specs_from_wire([["float32", [ELEMS], 0]]), "none", encrypted=True,
                         checked=True)
    leader = FakeLeader(net.loop, net.key, key, schema, ELEMS, followers=1)
    leader.listed.append(GroupMember(bytes.fromhex(d2.info["peer_id"]), d2_decl.endpoint,
                                     d2_decl.weight, False, d2_decl.bandwidth,
                                     d2_decl.data_endpoint))
    leader.hand_out_group()  # it holds nothing back
    try:
        leader.declare([d.dht for d in net.swarm.daemons], ttl=IN_AN_ATTEMPT)
        ids = net.ids[:2]
        inputs = inputs_of(ids, 30)

        def average(i: int) -> set[str]:
            with moshpit.Client(net.swarm.sockets[i]) as c:
                (out,) = c.average([inputs[ids[i]]], key=key, group_size=3, min_group_size=2,
                                   timeout=20)
                return check_round(out, c.last_round, ids[i], inputs, dict.fromkeys(ids, 1.0))

        assert run_parallel([lambda i=i: average(i) for i in range(2)]) == [set(ids)] * 2
        assert len(leader.joins) >= 1  # it did lead them
        warned = [d.log_path.read_text() for d in net.swarm.daemons[:2]]
        assert any("never asked this leader to lead it" in w for w in warned), warned[0][-2000:]
    finally:
        leader.close()
