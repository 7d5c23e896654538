"""Daemon settings from flags, `MOSHPITD_*` environment variables and a TOML file.

Every setting has one name: `part_size` is the file key, `MOSHPITD_PART_SIZE` the environment
variable and `--part-size` the flag. Precedence: flags > environment > file > defaults. A value
is checked once, here, whatever its source, so a typo in any of them stops the daemon at start
with the key's name and the reason instead of surfacing as odd behaviour mid-training.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ENV_PREFIX = "MOSHPITD_"
# variables with that prefix that are not settings (fault injection for tests, the file path)
ENV_OTHER = frozenset({"MOSHPITD_CONFIG", "MOSHPITD_FAULT", "MOSHPITD_FAULT_MARKER"})
DEFAULT_CONFIG = "/etc/moshpitd/moshpitd.toml"


class ConfigError(ValueError):
    """A setting with an unknown key or a bad value; the message names the key and source."""


HostPort = tuple[str, int]


def parse_hostport(text: str) -> HostPort:
    """host:port or [v6]:port; port 0 means any free port."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"port of {text!r} is not a number") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"port {number} of {text!r} is out of range 0..65535")
    return host, number


def _hostport(value: Any) -> HostPort:
    if not isinstance(value, str):
        raise ValueError(f"expected a \"HOST:PORT\" string, got {type(value).__name__}")
    return parse_hostport(value)


def _hostports(value: Any) -> list[HostPort]:
    """An array of "HOST:PORT" strings (file) or a comma-separated string (flag, env)."""
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, list):
        raise ValueError(f"expected a list of \"HOST:PORT\" strings, got {type(value).__name__}")
    return [_hostport(v) for v in value]


def _int(lo: int, hi: int) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        if isinstance(value, str):
            value = int(value.strip(), 0)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer, got {type(value).__name__}")
        if not lo <= value <= hi:
            raise ValueError(f"{value} is outside {lo}..{hi}")
        return value
    return check


def _float(lo: float, hi: float, open_low: bool = False) -> Callable[[Any], float]:
    def check(value: Any) -> float:
        if isinstance(value, str):
            value = float(value.strip())
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"expected a number, got {type(value).__name__}")
        value = float(value)
        if not (lo < value if open_low else lo <= value) or not value <= hi:
            raise ValueError(f"{value} is outside {'(' if open_low else '['}{lo}, {hi}]")
        return value
    return check


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {type(value).__name__}")
    return value


def _choice(*choices: str, upper: bool = False) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        text = _str(value).strip()
        text = text.upper() if upper else text.lower()
        if text not in choices:
            raise ValueError(f"{value!r} is not one of {', '.join(choices)}")
        return text
    return check


@dataclass(frozen=True)
class Option:
    key: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    metavar: str = ""
    flag_kind: str = "value"  # "value" or "bool"

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.key.upper()

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")


OPTIONS: tuple[Option, ...] = (
    Option("dht_listen", _hostport, ("127.0.0.1", 0), "UDP address of the DHT", "HOST:PORT"),
    Option("grpc_listen", _hostport, ("127.0.0.1", 0),
           "TCP address for peers' gRPC streams and the health service", "HOST:PORT"),
    Option("data_port", _int(0, 65535), 0, "TCP port of the tensor data plane, on the gRPC host",
           "PORT"),
    Option("advertise_host", _str, "",
           "address peers use to reach this daemon (default: the gRPC host, or for a wildcard "
           "host the local address of the route to the first bootstrap peer)", "HOST"),
    Option("bootstrap", _hostports, [], "DHT addresses of running daemons; a name resolves to "
           "all its addresses", "HOST:PORT[,HOST:PORT...]"),
    Option("ipc_socket", _str, "/run/moshpitd/moshpitd.sock", "unix socket for trainers", "PATH"),
    Option("metrics_listen", _hostport, ("127.0.0.1", 9464), "Prometheus /metrics address",
           "HOST:PORT"),
    Option("part_size", _int(1 << 12, 64 << 20), 1 << 20, "bytes per streamed part", "BYTES"),
    Option("bandwidth", _float(0.0, 1e12, open_low=True), 1.0,
           "relative share of each vector this peer reduces", "SHARE"),
    Option("client_mode", _bool, False,
           "this peer cannot accept connections (NAT): it never leads or reduces",
           flag_kind="bool"),
    Option("ready_file", _str, "", "write bound addresses here as JSON once listening", "PATH"),
    Option("log_level", _choice("DEBUG", "INFO", "WARNING", "ERROR", upper=True), "INFO",
           "log level", "LEVEL"),
    Option("log_format", _choice("text", "json"), "text", "text for people, json for machines",
           "FORMAT"),
    Option("drain_timeout", _float(0.0, 600.0), 10.0,
           "seconds a SIGTERM may take: rounds in progress finish within it", "SECONDS"),
    # --- security (moshpitd/auth.py, moshpitd/transport/security.py)
    Option("swarm_key_file", _str, "", "pre-shared secret (>= 16 bytes, mode 600): every DHT "
           "datagram, gRPC message and data-plane stream is authenticated with it", "PATH"),
    Option("tls_cert", _str, "", "PEM certificate for mutual TLS on gRPC", "PATH"),
    Option("tls_key", _str, "", "PEM private key of tls_cert", "PATH"),
    Option("tls_ca", _str, "", "PEM CA bundle that peers' certificates must chain to", "PATH"),
    Option("tls_server_name", _str, "", "name expected in peers' certificates (default: the "
           "dialled host, which then needs an IP SAN)", "NAME"),
    # --- limits: each refusal says which limit and how to raise it
    Option("max_request_bytes", _int(1, 1 << 40), 4 << 30,
           "tensor bytes one averaging request may carry", "BYTES"),
    Option("max_group_size", _int(2, 1024), 256,
           "largest group a request may ask for or this daemon will lead", "N"),
    Option("dht_max_records_per_key", _int(1, 1 << 16), 256,
           "records (one per peer) this daemon stores under one DHT key", "N"),
    Option("dht_max_value_bytes", _int(64, 4096), 1024, "bytes of one DHT record's value (a "
           "record travels in one datagram)", "BYTES"),
    Option("max_ipc_sessions", _int(1, 1 << 16), 64, "trainer connections at once", "N"),
    Option("max_message_bytes", _int(1 << 16, 1 << 30), 64 << 20,
           "largest gRPC message sent or received", "BYTES"),
    Option("max_parts_in_flight", _int(1, 1 << 16), 64,
           "parts a sender streams to a reducer before that reducer has answered them", "N"),
)
BY_KEY = {o.key: o for o in OPTIONS}


@dataclass(frozen=True)
class Settings:
    dht_listen: HostPort = ("127.0.0.1", 0)
    grpc_listen: HostPort = ("127.0.0.1", 0)
    data_port: int = 0
    advertise_host: str = ""
    bootstrap: list[HostPort] = field(default_factory=list)
    ipc_socket: str = "/run/moshpitd/moshpitd.sock"
    metrics_listen: HostPort = ("127.0.0.1", 9464)
    part_size: int = 1 << 20
    bandwidth: float = 1.0
    client_mode: bool = False
    ready_file: str = ""
    log_level: str = "INFO"
    log_format: str = "text"
    drain_timeout: float = 10.0
    swarm_key_file: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    tls_server_name: str = ""
    max_request_bytes: int = 4 << 30
    max_group_size: int = 256
    dht_max_records_per_key: int = 256
    dht_max_value_bytes: int = 1024
    max_ipc_sessions: int = 64
    max_message_bytes: int = 64 << 20
    max_parts_in_flight: int = 64
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def describe(self) -> dict[str, Any]:
        """Every setting with its effective value and where it came from."""
        out: dict[str, Any] = {}
        for o in OPTIONS:
            value = getattr(self, o.key)
            if o.parse is _hostport:
                value = f"{value[0]}:{value[1]}"
            elif o.parse is _hostports:
                value = [f"{h}:{p}" for h, p in value]
            out[o.key] = {"value": value, "source": self.sources.get(o.key, "default")}
        return out


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting; SUPPRESS keeps absent flags out of the namespace (precedence)."""
    for o in OPTIONS:
        text = f"{o.help} (default {o.default!r}; env {o.env})"
        if o.flag_kind == "bool":
            parser.add_argument(o.flag, dest=o.key, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=text)
        else:
            parser.add_argument(o.flag, dest=o.key, default=argparse.SUPPRESS,
                                metavar=o.metavar or None, help=text)


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
    tls = [k for k in ("tls_cert", "tls_key", "tls_ca") if values.get(k)]
    if tls and len(tls) != 3:
        missing = sorted({"tls_cert", "tls_key", "tls_ca"} - set(tls))
        raise ConfigError(f"TLS needs tls_cert, tls_key and tls_ca together; {', '.join(tls)} "
                          f"set but {', '.join(missing)} missing")
    return Settings(**values, sources=sources)


def config_keys() -> Sequence[str]:
    return [o.key for o in OPTIONS]
