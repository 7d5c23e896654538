"""What a holder of the swarm key can no longer do to the DHT, on real daemons.

The attacker here is a member: it holds the swarm key and speaks raw DHT datagrams in the
protocol's own encoding, sealed with that key, with peer keys of its own. It can make as many
identities as it likes, but none is a victim's. Each test passes when the honest peers' rounds
give the exact mean with every honest member counted, never merely because a round completed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import pytest
import torch
from kademlia.utils import digest

import moshpit
from bench.attacks.dht_wire import RawDHT, hostport
from moshpitd.auth import SwarmKey
from moshpitd.dht.records import MAX_TTL, sign, signed_bytes
from moshpitd.identity import PeerKey, peer_id_of, verify
from moshpitd.launcher import DaemonProcess, LocalSwarm
from moshpitd.matchmaking.declaration import Declaration
from tests.integration.helpers import run_parallel, scrape
from tests.integration.test_grid import check_round

FLOOD_KEYS = 4200  # more than the store's 4096-key cap
FLOOD_VALUE = 4096  # bytes per flooded record (dht_max_value_bytes at its largest)
STORE_BYTES = 2 << 20  # dht_max_bytes for the flooded daemons, scaled down
BURST = 16  # datagrams sent before waiting for their answers: a default socket buffer holds them


def swarm_key(tmp_path: Path) -> tuple[SwarmKey, list[str]]:
    secret = os.urandom(32).hex().encode()
    path = tmp_path / "swarm.key"
    path.write_bytes(secret)
    path.chmod(0o600)
    return SwarmKey(secret), ["--swarm-key-file", str(path)]


def rss_bytes(daemon: DaemonProcess) -> int:
    with open(f"/proc/{daemon.proc.pid}/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def average_all(swarm: LocalSwarm, key: str, elems: int = 20_000, **kw: object
                ) -> list[set[str]]:
    """Every daemon's trainer averages distinct values under `key`; each result must be the
    exact mean of the members its round reports, and those must be all the daemons."""
    ids = [d.info["peer_id"] for d in swarm.daemons]
    inputs = {pid: torch.randn(elems, generator=torch.Generator().manual_seed(i))
              for i, pid in enumerate(ids)}

    def one(i: int) -> set[str]:
        with moshpit.Client(swarm.sockets[i]) as c:
            (out,) = c.average([inputs[ids[i]]], key=key, timeout=20, **kw)  # type: ignore
            info = c.last_round
            assert info is not None and info.fully_averaged, info
            return check_round(out, info, ids[i], inputs, dict.fromkeys(ids, 1.0))
    groups = run_parallel([lambda i=i: one(i) for i in range(len(ids))])
    for g in groups:
        assert g == set(ids), groups  # each an exact mean over every honest peer
    return groups  # type: ignore[no-any-return]


@pytest.fixture
def keyed_swarm(tmp_path: Path) -> Iterator[Callable[..., tuple[LocalSwarm, SwarmKey]]]:
    swarms: list[LocalSwarm] = []

    def make(size: int, *extra: str) -> tuple[LocalSwarm, SwarmKey]:
        key, args = swarm_key(tmp_path)
        swarm = LocalSwarm(size, workdir=tmp_path / f"s{len(swarms)}",
                           extra_args=[*args, *extra])
        swarms.append(swarm)
        return swarm.start(), key

    yield make
    for swarm in swarms:
        swarm.stop()


def test_records_under_someone_elses_id_are_refused(
        keyed_swarm: Callable[..., tuple[LocalSwarm, SwarmKey]]) -> None:
    """Attack: tombstones, declarations and donor records written under each victim's peer
    id, with versions just under the old 600 s future guard, on every daemon before the
    victims declare; then, with the victims' public keys read from their own records, their
    records altered and re-sent. Before peer keys, each victim found nobody for ten minutes."""
    swarm, key = keyed_swarm(3)
    attacker = PeerKey.generate()
    victims = [bytes.fromhex(d.info["peer_id"]) for d in swarm.daemons]
    ahead = time.time_ns() + 599 * 10**9
    now = time.time_ns()
    lure = Declaration("127.0.0.1:9", b"\x00" * 32).pack()  # a leader nobody can reach
    donor = msgpack.packb(["127.0.0.1:9", 10**9, 1000])
    with RawDHT(key) as raw:
        for d in swarm.daemons:
            addr = hostport(d.dht)
            for victim in victims:
                forged = {
                    "unsigned tombstone": raw.store_sub(addr, "round", attacker, b"", ahead,
                                                        subkey=victim, proof=[]),
                    "tombstone signed by the attacker": raw.store_sub(
                        addr, "round", attacker, b"", ahead, subkey=victim),
                    "declaration signed by the attacker": raw.store_sub(
                        addr, "round", attacker, lure, now, subkey=victim),
                    "donor record signed by the attacker": raw.store_sub(
                        addr, "state/donors", attacker, donor, now, subkey=victim),
                    "another key's signature": raw.store_sub(
                        addr, "round", attacker, b"", ahead, subkey=victim,
                        proof=[60.0, os.urandom(32), attacker.sign(b"x")]),
                }
                assert set(forged.values()) == {False}, forged
            # under its own id, the attacker still cannot date a record far ahead (it would
            # outrank the records it writes later) or past its signed lifetime
            assert raw.store_sub(addr, "round", attacker, lure, ahead) is False
            assert raw.store_sub(addr, "round", attacker, lure,
                                 time.time_ns() - 2 * 3600 * 10**9, ttl=MAX_TTL) is False
            raw.leave(addr)
    for d in swarm.daemons:  # counted; those under a daemon's own id it refuses outright
        m = scrape(d)
        others = len(victims) - 1
        assert m['moshpitd_auth_rejected_total{plane="dht_record"}'] >= 5 * others + 2, m
        assert m['moshpitd_dht_records_refused_total{reason="wrong_signer"}'] >= 4 * others, m
        assert m['moshpitd_dht_records_refused_total{reason="version"}'] >= 2, m

    average_all(swarm, "round", group_size=3)

    # The victims withdrew: their signed tombstones carry their public keys. Altered, or
    # signed with the right public key by the wrong private key, none is taken. Each daemon is
    # sent the records it holds itself: one holding a newer record than another daemon's
    # would refuse an alteration of the older one as stale, before any signature check.
    with RawDHT(key) as raw:
        first = hostport(swarm.daemons[0].dht)
        assert {bytes(r[0]) for r in raw.find_subs(first, "round")} == set(victims)
        for d in swarm.daemons:
            addr = hostport(d.dht)
            genuine = raw.find_subs(addr, "round")
            bad_before = scrape(d).get(
                'moshpitd_dht_records_refused_total{reason="bad_signature"}', 0.0)
            others = 0
            for sk, value, version, ttl, (signed_ttl, public, signature) in genuine:
                assert peer_id_of(public) == sk  # what the daemons hold is the writers' own
                assert verify(public, signature, signed_bytes(digest("round"), sk, value,
                                                              version, signed_ttl))
                others += bytes(sk) != bytes.fromhex(d.info["peer_id"])
                altered = {
                    "a newer version": raw.store_sub(addr, "round", attacker, value,
                                                     version + 10**9, ttl, subkey=sk,
                                                     proof=[signed_ttl, public, signature]),
                    "a longer life": raw.store_sub(addr, "round", attacker, value, version,
                                                   ttl, subkey=sk,
                                                   proof=[MAX_TTL, public, signature]),
                    "the attacker's signature": raw.store_sub(
                        addr, "round", attacker, b"", version + 1, ttl, subkey=sk,
                        proof=[signed_ttl, public, attacker.sign(b"")]),
                }
                assert set(altered.values()) == {False}, altered
            raw.leave(addr)
            # every alteration of another's record reached the signature check and failed it
            # (those under the daemon's own id it refuses outright)
            bad = scrape(d)['moshpitd_dht_records_refused_total{reason="bad_signature"}']
            assert others >= 1 and bad - bad_before == 3 * others, (others, bad_before, bad)
    for d in swarm.daemons:
        assert d.alive() and "Traceback" not in d.log_path.read_text()

    average_all(swarm, "round", group_size=3)  # the same key again: its records are theirs


def test_a_flood_of_keys_neither_locks_out_new_keys_nor_grows_memory(
        keyed_swarm: Callable[..., tuple[LocalSwarm, SwarmKey]]) -> None:
    """Attack: 4200 keys, each a 4 KiB record living an hour, from 42 identities (100 records
    each), sent to every daemon. Before, the 4096-key cap then refused every new key for an
    hour (grid runs need one each round), and memory grew with the count of records, not
    their bytes. Now new keys displace the flood's least recently used ones, and the store
    holds at most dht_max_bytes."""
    swarm, key = keyed_swarm(2, "--dht-max-bytes", str(STORE_BYTES),
                             "--dht-max-value-bytes", str(FLOOD_VALUE),
                             "--dht-max-records-per-peer", "100")
    writers = [PeerKey.generate() for _ in range(FLOOD_KEYS // 100)]
    version = time.time_ns()
    records = []
    for i in range(FLOOD_KEYS):
        writer, value = writers[i // 100], os.urandom(FLOOD_VALUE)
        records.append((f"flood/{i}", writer, value,
                        sign(writer, digest(f"flood/{i}"), value, version, MAX_TTL).wire()))
    rss_before = {d.name: rss_bytes(d) for d in swarm.daemons}
    with RawDHT(key) as raw:
        for d in swarm.daemons:
            addr = hostport(d.dht)
            accepted = 0
            for start in range(0, FLOOD_KEYS, BURST):  # in bursts the socket buffer holds
                ids = {raw.store_sub(addr, k, w, v, version, MAX_TTL, proof=p, send_only=True)
                       for k, w, v, p in records[start:start + BURST]}
                answers = raw.replies(ids, timeout=30)
                assert len(answers) == len(ids), f"{d.name} answered {len(answers)} of {len(ids)}"
                accepted += sum(1 for a in answers.values() if a is True)
            assert accepted == FLOOD_KEYS  # every record was valid: taken, older ones dropped
            # one identity cannot take more than its share (the last still holds all of its)
            assert raw.store_sub(addr, "flood/extra", writers[-1], b"x") is False
            # a new key still goes in, at once
            assert raw.store_sub(addr, "new-key", PeerKey.generate(), b"x") is True
            raw.leave(addr)
    for d in swarm.daemons:
        m = scrape(d)
        assert m["moshpitd_dht_stored_bytes"] <= STORE_BYTES, m
        assert m["moshpitd_dht_records_evicted_total"] >= FLOOD_KEYS - STORE_BYTES // FLOOD_VALUE
        grown = rss_bytes(d) - rss_before[d.name]
        # the flood carried 17 MiB of values; the store may hold 2 MiB of them
        assert grown < 8 << 20, f"{d.name} grew by {grown / 2**20:.1f} MiB"

    # rounds on new keys: a plain one, and a grid run that needs a new key every round
    average_all(swarm, "after-flood", group_size=2)
    for _ in range(2):
        average_all(swarm, "grid-after-flood", grid=(2, 1))
