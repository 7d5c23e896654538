"""Daemon settings from flags, `MOSHPITD_*` environment variables and a TOML file.

Every option is declared once, as a field of `Settings` (moshpitd/option.py says how): its
name gives the file key `part_size`, the environment variable `MOSHPITD_PART_SIZE` and the flag
`--part-size`; its kind says how a value is read and bounded. Precedence: flags > environment >
file > defaults. A value is checked once, here, whatever its source, so a typo in any of them
stops the daemon at start with the key's name, its source and the reason instead of surfacing
as odd behaviour mid-training. Adding an option is one `option(...)` line below plus its use;
`python -m moshpitd.config_docs` then rewrites the example file and the settings table in
docs/operator.md.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from moshpitd.option import (
    BOOL,
    ENV_PREFIX,
    HOSTPORT,
    HOSTPORTS,
    Choice,
    Float,
    HostPort,
    Int,
    Str,
    declared,
    option,
    parse_hostport,
)

# variables with that prefix that are not settings (fault injection for tests, the file path)
ENV_OTHER = frozenset({"MOSHPITD_CONFIG", "MOSHPITD_FAULT", "MOSHPITD_FAULT_MARKER"})
DEFAULT_CONFIG = "/etc/moshpitd/moshpitd.toml"

NETWORK = "Network"
TRAINERS = "Trainers"
AVERAGING = "Averaging"
OPERATIONS = "Operations"
SECURITY = "Security"
LIMITS = "Limits: a request or peer over one is refused with a message naming the setting"

__all__ = ["BY_KEY", "OPTIONS", "ConfigError", "HostPort", "Settings", "add_flags",
           "config_keys", "load", "parse_hostport"]


class ConfigError(ValueError):
    """A setting with an unknown key or a bad value; the message names the key and source."""


@dataclass(frozen=True)
class Settings:
    """Every daemon option, declared once."""

    # --- network
    dht_listen: HostPort = option(
        HOSTPORT, ("127.0.0.1", 0), NETWORK,
        "UDP address of the Kademlia DHT node: peers find each other here",
        example="0.0.0.0:7700")
    grpc_listen: HostPort = option(
        HOSTPORT, ("127.0.0.1", 0), NETWORK,
        "TCP address of the gRPC service: matchmaking, state downloads for peers joining a "
        "running job, and the standard grpc.health.v1 health service",
        example="0.0.0.0:7701")
    data_port: int = option(
        Int(0, 65535), 0, NETWORK,
        "TCP port of the tensor data plane, on the host of grpc_listen; 0 picks any free port",
        note="Any free port is fine on one machine, but a firewall then cannot know which port "
        "to open.", example=7702)
    data_congestion_control: str = option(
        Choice(("cubic", "bbr", "reno", "system")), "cubic", NETWORK,
        "TCP congestion control of the data plane's connections; system: the host's default "
        "(net.ipv4.tcp_congestion_control)",
        note="A round runs 2 (n - 1) connections per daemon at once, which share each link's "
        "queue. With BBR (v1) they overshoot a shallow queue: on 4 hosts at 100 Mbit/s behind "
        "a 20 ms tbf queue, 10-34 % of the segments were sent again and rounds took 1.42 s; "
        "with cubic 1-2 % and 1.31 s (docs/wire.md). A kernel without the chosen algorithm "
        "keeps its default, with a warning.")
    advertise_host: str = option(
        Str("HOST"), "", NETWORK,
        "address peers use to reach this daemon, published in the DHT with its ports; empty: "
        "the host of grpc_listen or, when that is a wildcard such as 0.0.0.0, the local address "
        "of the route to the first bootstrap peer",
        note="Set it to the public address behind NAT with port forwarding, or to the pod IP in "
        "Kubernetes.")
    bootstrap: list[HostPort] = option(
        HOSTPORTS, [], NETWORK,
        "DHT addresses of daemons already running; a host name resolves to every address it "
        "has, so a headless Kubernetes Service works",
        note="A daemon started before all of them keeps retrying: the order in which daemons "
        "start does not matter. Leave it empty only on the very first daemon of a swarm.",
        example=["10.0.0.1:7700", "10.0.0.2:7700"])
    dht_rpc_timeout: float = option(
        Float(0.05, 60.0, unit="s"), 1.0, NETWORK,
        "seconds a DHT request waits for its answer before the contact counts as silent",
        note="Two unanswered requests in a row drop a contact. Raise it only on links whose "
        "round trip nears a second; it must stay below matchmaking_attempt_timeout, since "
        "an attempt's DHT lookups run within it.")
    # --- trainers
    ipc_socket: str = option(
        Str("PATH"), "/run/moshpitd/moshpitd.sock", TRAINERS,
        "unix socket trainers connect to (mode 0660: the daemon's user and group)")
    # --- averaging
    part_size: int = option(
        Int(4096, 64 << 20, unit="bytes"), 1 << 20, AVERAGING,
        "largest streamed part of a tensor; every daemon of a swarm must use the same",
        note="A round cuts smaller parts, down to 64 KiB, where one would take over 50 ms on "
        "its group's slowest declared link: a reducer sends a part's result once that part is "
        "in from every member, so a slow link's parts set how long the round's pipeline takes "
        "to fill.")
    bandwidth: float = option(
        Float(0.0, 1e12, unit="Mbit/s"), 0.0, AVERAGING,
        "the link rate this peer declares to its groups, which size spans so that a round's "
        "expected time is least at the members' rates; 0: the rate it measures in its own "
        "rounds (the slower of sending and receiving)",
        note="A value above 0 overrides the measured rate (it is not a cap): set it where "
        "measurements mislead, e.g. a link shared with other traffic. Rates are self-reported, "
        "so no peer reduces more than twice an equal share of a group's vector, whatever it "
        "declares; declaring less only lowers a peer's own share.")
    client_mode: bool = option(
        BOOL, False, AVERAGING, "this peer never leads a group and reduces nothing, but still "
        "contributes and receives the average (reachability finds NAT by itself)")
    reachability: str = option(
        Choice(("auto", "public", "private")), "auto", AVERAGING,
        "auto: find out, by asking peers to dial this daemon back, whether it is public or "
        "behind NAT; public or private: take that without asking",
        note="A private daemon is a DHT client, keeps a reservation at a public peer that "
        "relays for it and advertises the relay's ports: it still owns spans and leads (as in "
        "client_mode until it holds one). `moshpit status` and /metrics say which, and why.")
    relay: bool = option(BOOL, True, AVERAGING, "relay for private peers when this daemon is "
                         "public (what a relay sees: docs/security-identity.md)")
    direct_paths: bool = option(BOOL, True, AVERAGING, "while relayed, offer the members of "
                                "each round connections this daemon dials (deploy/"
                                "bootstrapping.md, Direct paths)")
    matchmaking_attempt_timeout: float = option(
        Float(0.1, 600.0, unit="s"), 5.0, AVERAGING,
        "upper bound on one matchmaking attempt, within the request's own timeout",
        note="A request that finds no group in one attempt declares itself again for the next; "
        "a grid round gives up after one. A peer's declaration ending more than two of these "
        "after ours is ignored, so give every daemon of a swarm a similar value. A data-plane "
        "stream for a group this daemon has not learnt of yet waits two attempts.")
    # --- operations
    metrics_listen: HostPort = option(
        HOSTPORT, ("127.0.0.1", 9464), OPERATIONS, "address of the Prometheus /metrics endpoint",
        note="Loopback by default; use 0.0.0.0:9464 for a remote Prometheus.")
    ready_file: str = option(
        Str("PATH"), "", OPERATIONS,
        "once listening, write the bound addresses here as JSON (peer_id, dht, grpc, data, ipc, "
        "metrics), atomically; empty: no file",
        note="Scripts wait for this file instead of sleeping. Under systemd, e.g. "
        "\"/run/moshpitd/ready.json\".")
    log_level: str = option(
        Choice(("DEBUG", "INFO", "WARNING", "ERROR"), upper=True), "INFO", OPERATIONS,
        "log level")
    log_format: str = option(
        Choice(("text", "json")), "text", OPERATIONS,
        "how log records are written: text, one line each for people, or json, one object "
        "per line for machines (round lines carry key, group_size, bytes_sent, "
        "bytes_received, seconds and result as fields)")
    drain_timeout: float = option(
        Float(0.0, 600.0, unit="s"), 10.0, OPERATIONS,
        "seconds a SIGTERM may take: the daemon finishes or leaves its current round, "
        "withdraws its DHT records and exits within it",
        note="Keep it below the service manager's stop timeout (TimeoutStopSec=30 in "
        "moshpitd.service, terminationGracePeriodSeconds in Kubernetes).")
    # --- security (moshpitd/auth.py, moshpitd/transport/security.py)
    swarm_key_file: str = option(
        Str("PATH"), "", SECURITY,
        "pre-shared secret (at least 16 bytes, not readable by others): every DHT datagram, "
        "gRPC message and data-plane stream is authenticated with it; empty: no key (trusted "
        "networks only)",
        note="Like a libp2p private network: HMAC-SHA256 with a timestamp and a nonce, replays "
        "dropped, so a daemon without the key can neither read nor store records nor join a "
        "group. Make one with `openssl rand -hex 32 > swarm.key && chmod 600 swarm.key` and "
        "give every daemon of the swarm the same file; under systemd, pass it as a credential "
        "(see deploy/README.md). A message may be dated at most 30 s behind the receiver's "
        "clock and 5 s ahead of it: keep clocks in sync (NTP).")
    peer_key_file: str = option(
        Str("PATH"), "", SECURITY,
        "this daemon's Ed25519 private key, its identity: the peer id is the hash of its public "
        "key and every DHT record it writes is signed with it; created (mode 0600) on first "
        "start; empty: peer.key in $STATE_DIRECTORY under systemd, else in /var/lib/moshpitd "
        "where this user may write there, else in $XDG_STATE_HOME/moshpitd "
        "(~/.local/state/moshpitd)",
        note="Keep it across restarts and never share it between daemons: two daemons with one "
        "key are one peer to the swarm. A running daemon locks its file, and a second daemon "
        "given the same file exits at once naming the file and the holder's pid. A file "
        "readable by others, or one that holds no Ed25519 key, stops the daemon at start. "
        "Several daemons of one user on one host need a file each.")
    data_encryption: str = option(
        Choice(("auto", "off")), "auto", SECURITY,
        "auto: data-plane streams are encrypted and every frame authenticated (AES-256-GCM, "
        "keys from each stream's signed handshake) whenever swarm_key_file or TLS is set; "
        "off: they never are",
        note="Every daemon of a swarm needs the same effective setting: a stream between a "
        "daemon that encrypts and one that does not is refused. `off` saves the cipher's CPU "
        "(about 0.4 ns per byte sent or received) on a network you trust: the handshake still "
        "proves each stream's peer, but the frames after it can be read and altered on the "
        "way.")
    check_results: str = option(
        Choice(("auto", "on", "off")), "auto", SECURITY,
        "auto: every member checks each other owner's span, at 128 coordinates drawn after its "
        "results were sent, against what the span's contributors say they sent (signed), and "
        "applies it only if it agrees, whenever swarm_key_file or TLS is set; on: always; off: "
        "never",
        note="Part of what peers match on: daemons with different effective settings never "
        "group. A span that fails keeps the trainer's own values, and its owner is named in the "
        "log and /metrics and no longer grouped with. Checks mean and trimmed_mean; "
        "centered_clip rounds run unchecked (docs/security-identity.md, \"Checked "
        "reductions\"). The cost is two round trips at a round's end and a copy of the "
        "results; `off` saves them in a swarm whose members trust each other.")
    tls_cert: str = option(
        Str("PATH"), "", SECURITY,
        "PEM certificate for mutual TLS on gRPC (matchmaking, state downloads, health); "
        "tls_cert, tls_key and tls_ca are set together or not at all")
    tls_key: str = option(Str("PATH"), "", SECURITY, "PEM private key of tls_cert")
    tls_ca: str = option(Str("PATH"), "", SECURITY,
                         "PEM CA bundle that peers' certificates must chain to")
    tls_server_name: str = option(
        Str("NAME"), "", SECURITY,
        "name expected in peers' certificates; empty: the dialled address, which then needs an "
        "IP SAN")
    # --- limits: each refusal says which limit and how to raise it
    max_request_bytes: int = option(
        Int(1, 1 << 40, unit="bytes"), 4 << 30, LIMITS,
        "tensor bytes one averaging request may carry")
    max_group_size: int = option(
        Int(2, 1024), 256, LIMITS, "largest group a request may ask for or this daemon will lead")
    dht_max_records_per_key: int = option(
        Int(1, 1 << 16), 256, LIMITS,
        "records (one per peer) this daemon stores under one DHT key; when full, a new "
        "writer's record takes the place of the one stored longest ago")
    dht_max_value_bytes: int = option(
        Int(64, 4096, unit="bytes"), 1024, LIMITS,
        "bytes of one DHT record's value (a record travels in one datagram)")
    dht_max_records_per_peer: int = option(
        Int(1, 1 << 20), 1024, LIMITS,
        "DHT records one writer (one peer id) may have stored on this daemon, over all keys")
    dht_max_bytes: int = option(
        Int(64 << 10, 16 << 30, unit="bytes"), 64 << 20, LIMITS,
        "memory this daemon's DHT store may hold, records and their bookkeeping counted",
        note="When full, the keys least recently written or read are dropped first, so a flood "
        "of new keys cannot lock new rounds out.")
    join_max_in_flight: int = option(
        Int(1, 1 << 16), 1024, LIMITS,
        "Join calls (peers asking this daemon to lead them) held open at once, over all keys",
        note="A leader holds a follower's call until its group assembles; a call past the "
        "limit is refused at once, and the peer asks another leader.")
    join_max_per_peer: int = option(
        Int(1, 1 << 10), 8, LIMITS,
        "Join calls one peer id may have open on this daemon at once, over all keys")
    grpc_max_connections: int = option(
        Int(1, 1 << 16), 1024, LIMITS, "connections to the gRPC port at once",
        note="Past it a new connection is closed at once. A connection that sends nothing "
        "within 10 s, or leaves our bytes untaken for 30 s, is closed too.")
    grpc_max_connections_per_address: int = option(
        Int(1, 1 << 16), 64, LIMITS, "connections to the gRPC port from one IP address at once",
        note="Loose on purpose: daemons on one host, or behind one NAT, share an address.")
    grpc_receive_rate: int = option(
        Int(1 << 10, 1 << 30, unit="bytes/s"), 16 << 10, LIMITS,
        "bytes a second the gRPC port reads from one IP address's connections together, or, "
        "once a peer has proven its key and that it lives, from that peer",
        note="A connection past its share (and its grpc_receive_burst) is not read from until "
        "the rate allows: a flood of requests waits in its sender's buffers, and other "
        "connections from the address do not wait for it. Every request is under 2 KiB and a "
        "peer sends a few a round; the default is some 40 joins a second.")
    grpc_receive_burst: int = option(
        Int(1 << 12, 1 << 30, unit="bytes"), 32 << 10, LIMITS,
        "bytes one gRPC connection (or, once proven, one peer) may send at once beyond "
        "grpc_receive_rate")
    grpc_accept_rate: float = option(
        Float(0.1, 1e6, unit="1/s"), 16.0, LIMITS,
        "new gRPC connections a second from one IP address, past grpc_accept_burst",
        note="A connection past it is closed at once: a flooder cannot open fresh "
        "connections for fresh grpc_receive_burst budgets. Peers reuse their connections, "
        "so an honest address opens a few.")
    grpc_accept_burst: int = option(
        Int(1, 1 << 16), 256, LIMITS, "new gRPC connections at once from one IP address")
    grpc_max_calls_per_address: int = option(
        Int(1, 1 << 16), 256, LIMITS, "calls (joins, state downloads) open at once on the gRPC "
        "port from one IP address")
    grpc_write_timeout: float = option(
        Float(1.0, 600.0, unit="s"), 30.0, LIMITS,
        "how long one gRPC response may wait for its caller to take it before the call is "
        "cancelled", note="A state chunk is 1 MiB: the default asks a downloader for 35 KB/s.")
    max_ipc_sessions: int = option(Int(1, 1 << 16), 64, LIMITS, "trainer connections at once")
    max_message_bytes: int = option(
        Int(1 << 16, 1 << 30, unit="bytes"), 64 << 20, LIMITS,
        "largest gRPC message sent or received")
    max_parts_in_flight: int = option(
        Int(1, 1 << 16), 64, LIMITS,
        "parts a sender streams to a reducer before that reducer has answered them")
    relay_max_reservations: int = option(
        Int(0, 4096), 16, LIMITS, "private peers this daemon relays for at once")
    relay_rate: float = option(
        Float(0.0, 1e6, unit="Mbit/s"), 100.0, LIMITS, "what one private peer's relayed "
        "connections may move through this daemon, both ways together; 0: no bound")

    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def describe(self) -> dict[str, Any]:
        """Every setting with its effective value (as a file or flag would give it) and where it
        came from: what `--check-config` prints."""
        return {o.key: {"value": o.kind.show(getattr(self, o.key)),
                        "source": self.sources.get(o.key, "default")} for o in OPTIONS}


OPTIONS = declared(Settings)
BY_KEY = {o.key: o for o in OPTIONS}


def config_keys() -> Sequence[str]:
    return [o.key for o in OPTIONS]


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting; SUPPRESS keeps absent flags out of the namespace (precedence)."""
    for o in OPTIONS:
        text = f"{o.doc} ({o.summary()}; env {o.env})".replace("%", "%%")
        if o.is_bool:
            parser.add_argument(o.flag, dest=o.key, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=text)
        else:
            parser.add_argument(o.flag, dest=o.key, default=argparse.SUPPRESS,
                                metavar=o.kind.metavar(), help=text)


def read_file(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except PermissionError:
        raise ConfigError(f"config file {path} is not readable") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - set(BY_KEY))
    if unknown:
        raise ConfigError(f"{path}: unknown key {unknown[0]!r} (known keys: "
                          f"{', '.join(BY_KEY)})")
    return data


def load(flags: Mapping[str, Any], env: Mapping[str, str] | None = None,
         config_path: str | None = None) -> Settings:
    """Merge the sources. A missing file is an error only if it was asked for explicitly."""
    env = os.environ if env is None else env
    unknown_env = sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in ENV_OTHER
                         and k[len(ENV_PREFIX):].lower() not in BY_KEY)
    if unknown_env:
        raise ConfigError(f"unknown environment variable {unknown_env[0]} (known: "
                          f"{', '.join(o.env for o in OPTIONS)})")
    path = config_path or env.get("MOSHPITD_CONFIG")
    file_values: dict[str, Any] = {}
    if path:
        file_values = read_file(path)
    elif os.path.exists(DEFAULT_CONFIG):
        path = DEFAULT_CONFIG
        file_values = read_file(path)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for o in OPTIONS:
        if o.key in flags:
            raw, source = flags[o.key], f"flag {o.flag}"
        elif o.env in env:
            raw, source = env[o.env], f"environment variable {o.env}"
        elif o.key in file_values:
            raw, source = file_values[o.key], f"key {o.key!r} in {path}"
        else:
            continue
        try:
            values[o.key] = o.parse(raw)
        except ValueError as exc:
            raise ConfigError(f"{source}: bad value for {o.key}: {exc}") from None
        sources[o.key] = source
    settings = Settings(**values, sources=sources)
    check_together(settings)
    return settings


def check_together(s: Settings) -> None:
    """Options that are only valid together."""
    tls = [k for k in ("tls_cert", "tls_key", "tls_ca") if getattr(s, k)]
    if tls and len(tls) != 3:
        missing = sorted({"tls_cert", "tls_key", "tls_ca"} - set(tls))
        raise ConfigError(f"TLS needs tls_cert, tls_key and tls_ca together; {', '.join(tls)} "
                          f"set but {', '.join(missing)} missing")
    if s.dht_rpc_timeout >= s.matchmaking_attempt_timeout:
        def said(key: str) -> str:
            return f"{getattr(s, key):g} s from {s.sources.get(key, 'the default')}"
        raise ConfigError(
            f"dht_rpc_timeout ({said('dht_rpc_timeout')}) must be below "
            f"matchmaking_attempt_timeout ({said('matchmaking_attempt_timeout')}): a "
            "matchmaking attempt's DHT lookups run within it")
