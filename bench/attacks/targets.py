"""The daemons under attack, as the soak publishes them: a JSON file it rewrites (atomically)
whenever a daemon is restarted, and the attacker reads again when it changed.

What the file says is what any member of the swarm can learn: each daemon's addresses and peer
id from the DHT, the matchmaking key and the tensors' schema from the declarations under it."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Target:
    name: str
    peer_id: bytes
    grpc: str
    dht: str
    data: str


@dataclass(frozen=True)
class Swarm:
    key: str  # the key the honest trainers average under
    schema: bytes  # their tensors' schema hash, as declarations carry it
    targets: tuple[Target, ...]


def write_targets(path: Path, key: str, schema: bytes, daemons: Sequence[dict[str, str]]
                  ) -> None:
    """`daemons`: each live daemon's ready info (moshpitd.launcher.DaemonProcess.info) and
    its "name"."""
    doc = {"key": key, "schema": schema.hex(), "targets": [
        {"name": d["name"], "peer_id": d["peer_id"], "grpc": d["grpc"], "dht": d["dht"],
         "data": d["data"]} for d in daemons]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


class TargetsFile:
    """The file's latest contents; read again only when it changed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._swarm: Swarm | None = None

    def read(self) -> Swarm:
        st = self.path.stat()
        stamp = (st.st_mtime_ns, st.st_ino)
        if self._swarm is None or stamp != self._stamp:
            doc = json.loads(self.path.read_text())
            self._swarm = Swarm(doc["key"], bytes.fromhex(doc["schema"]), tuple(
                Target(t["name"], bytes.fromhex(t["peer_id"]), t["grpc"], t["dht"], t["data"])
                for t in doc["targets"]))
            self._stamp = stamp
        return self._swarm
