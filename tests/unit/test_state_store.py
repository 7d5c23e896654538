"""Which state versions a donor keeps: the latest, a replaced one for a grace period, and
any a joiner is still downloading; nothing forever."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from moshpitd import state, timebase
from moshpitd.state import StateStore, range_digests


class FakeDHT:
    def __init__(self) -> None:
        self.records: dict[str, Any] = {}

    async def store_sub(self, key: str, sub: bytes, value: bytes, ttl: float) -> None:
        self.records[key] = value


def versions(store: StateStore, key: str = "run") -> list[int]:
    return [snap.version for snap in store.snapshots.get(key, [])]


def test_replaced_versions_expire_unless_leased(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(timebase.time, "monotonic", lambda: clock[0])
    store = StateStore(FakeDHT(), b"me", "127.0.0.1:1")  # type: ignore[arg-type]

    def publish(version: int, key: str = "run") -> None:
        asyncio.run(store.publish(key, [], {}, bytes(10), version))

    publish(1)
    publish(2)
    assert versions(store) == [1, 2]  # 1 was just replaced: a joiner may have its record
    store._find("run", 1).leased_until = clock[0] + 5  # type: ignore[union-attr]  # downloading
    publish(3)
    assert versions(store) == [1, 2, 3]
    publish(4)
    assert versions(store) == [1, 3, 4]  # 1 is leased, 3 just replaced, 2 had its grace
    publish(4)
    assert versions(store) == [1, 3, 4]  # the same version again replaces nothing
    clock[0] += 6  # the download of 1 is over
    publish(5)
    assert versions(store) == [4, 5]
    clock[0] += state.SUPERSEDED_GRACE + 1
    publish(6)
    assert versions(store) == [5, 6]
    publish(1, key="other")
    clock[0] += state.DONOR_TTL + 1
    publish(7)
    assert "other" not in store.snapshots
    assert versions(store) == [6, 7]  # nobody republished it: nobody advertises it


def test_range_digests_cover_every_byte() -> None:
    data = bytes(range(256)) * 100
    digests = range_digests(data, 1000)
    assert len(digests) == 26 and all(len(d) == 16 for d in digests)
    changed = bytearray(data)
    changed[25_599] ^= 1
    assert range_digests(bytes(changed), 1000)[:-1] == digests[:-1]
    assert range_digests(bytes(changed), 1000)[-1] != digests[-1]
