"""What a node is told at start, and the small types every layer shares with it."""

from __future__ import annotations

from dataclasses import dataclass

from moshpitd.auth import SwarmKey
from moshpitd.config import OPTIONS, Settings
from moshpitd.identity import PeerKey
from moshpitd.option import format_hostport
from moshpitd.transport.security import TLSFiles

__all__ = ["NodeConfig", "ShuttingDown", "format_hostport"]


class ShuttingDown(Exception):
    """The daemon is draining: it takes no new rounds and left the one it was matching for."""


@dataclass(frozen=True)
class NodeConfig(Settings):
    """Every option (declared in config.Settings, so none is restated here), with what the
    service makes of them at start: the advertised host resolved, the secrets loaded."""

    swarm_key: SwarmKey | None = None  # seals DHT datagrams, gRPC messages, data-plane HELLOs
    tls: TLSFiles | None = None  # mutual TLS on gRPC
    identity: PeerKey | None = None  # from peer_key_file; None: a key for this process only

    @classmethod
    def of(cls, settings: Settings, advertise_host: str, swarm_key: SwarmKey | None = None,
           tls: TLSFiles | None = None, identity: PeerKey | None = None) -> NodeConfig:
        values = {o.key: getattr(settings, o.key) for o in OPTIONS}
        values["advertise_host"] = advertise_host
        return cls(**values, swarm_key=swarm_key, tls=tls, identity=identity,
                   sources=settings.sources)
