"""Settings: flags > environment > file > defaults, and every bad value named at start."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moshpitd.cli import settings_from_argv
from moshpitd.config import OPTIONS, ConfigError, load
from moshpitd.option import HOSTPORT, HOSTPORTS, Choice, Float, Int, Option


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "moshpitd.toml"
    path.write_text(text)
    return str(path)


def test_precedence_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    path = write(tmp_path, 'part_size = 8192\nbandwidth = 2.5\nbootstrap = ["a:1", "b:2"]\n')
    env = {"MOSHPITD_PART_SIZE": "16384", "MOSHPITD_CLIENT_MODE": "yes"}
    s = load({"part_size": "32768"}, env, path)
    assert s.part_size == 32768 and s.sources["part_size"] == "flag --part-size"
    assert s.client_mode is True and "MOSHPITD_CLIENT_MODE" in s.sources["client_mode"]
    assert s.bandwidth == 2.5 and path in s.sources["bandwidth"]
    assert s.bootstrap == [("a", 1), ("b", 2)]
    assert s.log_level == "INFO" and "log_level" not in s.sources
    s = load({}, env, path)
    assert s.part_size == 16384
    s = load({}, {}, path)
    assert s.part_size == 8192


def test_every_setting_has_flag_env_and_file_key(tmp_path: Path) -> None:
    from moshpitd.cli import build_parser
    help_text = build_parser().format_help()
    for o in OPTIONS:
        assert o.flag in help_text and o.env in help_text, o.key
        assert o.env == "MOSHPITD_" + o.key.upper()
        assert getattr(load({}, {}, None), o.key) == o.default


@pytest.mark.parametrize("text, words", [
    ("part_siz = 8192\n", ["unknown key 'part_siz'"]),
    ("part_size = 100\n", ["part_size", "outside 4096"]),
    ("part_size = \"big\"\n", ["part_size", "invalid literal"]),
    ("bandwidth = -1\n", ["bandwidth", "outside"]),
    ("client_mode = \"maybe\"\n", ["client_mode", "true or false"]),
    ("grpc_listen = \"nohost\"\n", ["grpc_listen", "HOST:PORT"]),
    ("dht_listen = \"h:70000\"\n", ["dht_listen", "out of range"]),
    ("bootstrap = [1, 2]\n", ["bootstrap", "HOST:PORT"]),
    ("log_level = \"LOUD\"\n", ["log_level", "not one of"]),
    ("log_format = \"xml\"\n", ["log_format", "not one of"]),
    ("drain_timeout = -1\n", ["drain_timeout", "outside"]),
    ("data_port = true\n", ["data_port", "bool"]),
    ("this is not toml", ["not valid TOML"]),
])
def test_bad_file_values_are_rejected_with_key_and_reason(tmp_path: Path, text: str,
                                                          words: list[str]) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load({}, {}, path)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_bad_env_and_flag_values_name_their_source(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"MOSHPITD_PART_SIZE.*part_size"):
        load({}, {"MOSHPITD_PART_SIZE": "12"}, None)
    with pytest.raises(ConfigError, match="unknown environment variable MOSHPITD_PART_SIZ"):
        load({}, {"MOSHPITD_PART_SIZ": "8192"}, None)
    with pytest.raises(ConfigError, match="flag --bandwidth"):
        load({"bandwidth": "-3"}, {}, None)
    with pytest.raises(ConfigError, match="does not exist"):
        load({}, {}, str(tmp_path / "missing.toml"))
    # fault injection variables are not settings and are not refused
    assert load({}, {"MOSHPITD_FAULT": "stall@2"}, None).part_size == 1 << 20


def test_boolean_flag_can_override_env_either_way(tmp_path: Path) -> None:
    settings, _ = settings_from_argv(["--no-client-mode", "--config", write(tmp_path, "")])
    assert settings.client_mode is False
    settings, check = settings_from_argv(["--client-mode", "--check-config"])
    assert settings.client_mode is True and check


def run_cli(args: list[str], env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    import os
    base = {k: v for k, v in os.environ.items() if not k.startswith("MOSHPITD_")}
    return subprocess.run([sys.executable, "-m", "moshpitd", *args], capture_output=True,
                          text=True, env={**base, **(env or {})}, timeout=60)


def test_check_config_prints_effective_settings_and_exits(tmp_path: Path) -> None:
    path = write(tmp_path, 'part_size = 8192\nlog_format = "json"\n')
    out = run_cli(["--config", path, "--check-config", "--bandwidth", "3"],
                  {"MOSHPITD_DRAIN_TIMEOUT": "2.5"})
    assert out.returncode == 0, out.stderr
    settings = json.loads(out.stdout)
    assert settings["part_size"] == {"value": 8192, "source": f"key 'part_size' in {path}"}
    assert settings["bandwidth"]["value"] == 3.0
    assert settings["drain_timeout"] == {"value": 2.5,
                                         "source": "environment variable MOSHPITD_DRAIN_TIMEOUT"}
    assert settings["log_format"]["value"] == "json"


def test_daemon_refuses_to_start_on_a_bad_key(tmp_path: Path) -> None:
    path = write(tmp_path, "part_size = 8192\ngrpc_port = 5\n")
    out = run_cli(["--config", path])
    assert out.returncode == 2
    assert "unknown key 'grpc_port'" in out.stderr and path in out.stderr
    out = run_cli(["--check-config"], {"MOSHPITD_CONFIG": path})
    assert out.returncode == 2 and "grpc_port" in out.stderr


# --- one declaration per option --------------------------------------------------------------
def test_each_option_is_declared_once_and_everything_is_derived_from_it() -> None:
    from dataclasses import fields

    from moshpitd.cli import build_parser
    from moshpitd.config import Settings
    from moshpitd.node_config import NodeConfig

    keys = [o.key for o in OPTIONS]
    assert len(keys) == len(set(keys))
    # Settings holds exactly the options (plus where each value came from); the node's config
    # inherits them all and adds only what the service loads from them
    assert [f.name for f in fields(Settings)] == [*keys, "sources"]
    assert [f.name for f in fields(NodeConfig)] == [*keys, "sources", "swarm_key", "tls",
                                                   "identity"]
    flags = {a.dest: a.option_strings for a in build_parser()._actions}
    for o in OPTIONS:
        assert o.flag in flags[o.key], o.key
        # the default is a value of the option's kind, within its bounds, and survives the
        # round trip through --check-config's form (which is also what a file may say)
        assert o.kind.parse(o.kind.show(o.default)) == o.default, o.key
        assert o.kind.parse(o.kind.show(o.example_value())) == o.example_value(), o.key
        assert o.doc and o.section


def off_default(o: Option) -> object:
    """A valid value of `o` other than its default, in the form a file would give it."""
    kind = o.kind
    if isinstance(kind, Int | Float):
        return kind.hi if o.default != kind.hi else kind.lo
    if isinstance(kind, Choice):
        return next(c for c in kind.choices if c != o.default)
    if o.is_bool:
        return not o.default
    if kind is HOSTPORT:
        return "10.9.8.7:4242"
    if kind is HOSTPORTS:
        return ["10.9.8.7:4242"]
    return "/elsewhere/" + str(o.default)


def test_node_config_carries_every_option_of_the_settings() -> None:
    from moshpitd.node_config import NodeConfig

    # every option off its default: a field the node config dropped or restated would show
    settings = load({o.key: off_default(o) for o in OPTIONS}, {}, None)
    config = NodeConfig.of(settings, "203.0.113.7")
    for o in OPTIONS:
        assert getattr(settings, o.key) != o.default, o.key
        expected = "203.0.113.7" if o.key == "advertise_host" else getattr(settings, o.key)
        assert getattr(config, o.key) == expected, o.key
    assert config.dht_rpc_timeout == 60.0 and config.matchmaking_attempt_timeout == 600.0
    assert config.sources["dht_rpc_timeout"] == "flag --dht-rpc-timeout"


def test_new_timeouts_from_every_source(tmp_path: Path) -> None:
    path = write(tmp_path, "dht_rpc_timeout = 2\nmatchmaking_attempt_timeout = 12.5\n")
    s = load({}, {}, path)
    assert (s.dht_rpc_timeout, s.matchmaking_attempt_timeout) == (2.0, 12.5)
    s = load({"matchmaking_attempt_timeout": "20"},
             {"MOSHPITD_DHT_RPC_TIMEOUT": "3", "MOSHPITD_MATCHMAKING_ATTEMPT_TIMEOUT": "15"},
             path)
    assert (s.dht_rpc_timeout, s.matchmaking_attempt_timeout) == (3.0, 20.0)
    assert s.sources["dht_rpc_timeout"] == "environment variable MOSHPITD_DHT_RPC_TIMEOUT"
    s = load({}, {}, None)
    assert (s.dht_rpc_timeout, s.matchmaking_attempt_timeout) == (1.0, 5.0)  # today's values


@pytest.mark.parametrize("text, words", [
    ("dht_rpc_timeout = 0\n", ["dht_rpc_timeout", "outside [0.05, 60.0]"]),
    ("dht_rpc_timeout = 61\n", ["dht_rpc_timeout", "outside"]),
    ("dht_rpc_timeout = \"soon\"\n", ["dht_rpc_timeout", "could not convert"]),
    ("matchmaking_attempt_timeout = 0.01\n", ["matchmaking_attempt_timeout", "outside"]),
    ("matchmaking_attempt_timeout = true\n", ["matchmaking_attempt_timeout", "bool"]),
    ("matchmaking_seconds = 5\n", ["unknown key 'matchmaking_seconds'"]),
])
def test_bad_timeouts_are_rejected_with_key_and_reason(tmp_path: Path, text: str,
                                                       words: list[str]) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load({}, {}, path)
    for word in [*words, path]:
        assert word in str(info.value), (word, str(info.value))


def test_rpc_timeout_must_fit_in_a_matchmaking_attempt(tmp_path: Path) -> None:
    path = write(tmp_path, "dht_rpc_timeout = 5\n")
    with pytest.raises(ConfigError) as info:
        load({}, {}, path)
    text = str(info.value)
    assert "dht_rpc_timeout (5 s from key 'dht_rpc_timeout' in" in text
    assert "matchmaking_attempt_timeout (5 s from the default)" in text
    with pytest.raises(ConfigError, match=r"\(2 s from flag --matchmaking-attempt-timeout\)"):
        load({"matchmaking_attempt_timeout": "2"}, {"MOSHPITD_DHT_RPC_TIMEOUT": "3"}, None)
    assert load({"matchmaking_attempt_timeout": "6"}, {}, path).dht_rpc_timeout == 5.0


def test_check_config_shows_ipv6_addresses_as_they_are_written(tmp_path: Path) -> None:
    s = load({"grpc_listen": "[::1]:7701", "bootstrap": "[::1]:7700,10.0.0.1:7700"}, {}, None)
    shown = s.describe()
    assert shown["grpc_listen"]["value"] == "[::1]:7701"
    assert shown["bootstrap"]["value"] == ["[::1]:7700", "10.0.0.1:7700"]
    again = load({k: shown[k]["value"] for k in ("grpc_listen",)}, {}, None)
    assert again.grpc_listen == ("::1", 7701)


def test_a_bad_timeout_stops_the_daemon_at_start() -> None:
    out = run_cli(["--check-config"], {"MOSHPITD_MATCHMAKING_ATTEMPT_TIMEOUT": "-1"})
    assert out.returncode == 2
    assert "environment variable MOSHPITD_MATCHMAKING_ATTEMPT_TIMEOUT" in out.stderr
    assert "matchmaking_attempt_timeout" in out.stderr and "outside" in out.stderr
