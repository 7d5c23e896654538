"""What a node is told at start, and the small types every layer shares with it."""

from __future__ import annotations

from dataclasses import dataclass

from moshpitd.allreduce.layout import DEFAULT_PART_BYTES
from moshpitd.auth import SwarmKey
from moshpitd.transport.grpc_server import DEFAULT_MAX_MESSAGE
from moshpitd.transport.security import TLSFiles


class ShuttingDown(Exception):
    """The daemon is draining: it takes no new rounds and left the one it was matching for."""


def format_hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class NodeConfig:
    dht_host: str = "127.0.0.1"
    dht_port: int = 0
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 0
    advertise_host: str = ""  # how peers reach us; default grpc_host
    data_port: int = 0  # the data plane listens on grpc_host
    bandwidth: float = 1.0  # relative share of each vector this peer offers to reduce
    client_mode: bool = False
    bootstrap: tuple[tuple[str, int], ...] = ()
    dht_rpc_timeout: float = 1.0
    part_bytes: int = DEFAULT_PART_BYTES
    max_message: int = DEFAULT_MAX_MESSAGE
    matchmaking_seconds: float = 5.0
    swarm_key: SwarmKey | None = None  # seals DHT datagrams, gRPC messages, data-plane HELLOs
    tls: TLSFiles | None = None  # mutual TLS on gRPC
    max_group_size: int = 256
    max_request_bytes: int = 4 << 30
    dht_max_records_per_key: int = 256
    dht_max_value_bytes: int = 1024
    max_parts_in_flight: int = 64
