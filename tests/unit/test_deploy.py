"""The files in deploy/: the systemd unit verifies and is sandboxed, the configs parse."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from moshpitd.cli import build_parser
from moshpitd.config import config_keys

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "moshpitd.service"
CONFIG = DEPLOY / "moshpitd.toml"
MANIFEST = DEPLOY / "kubernetes" / "moshpitd.yaml"

# The keys the daemon's config loader accepts (it rejects any other).
CONFIG_KEYS = frozenset(config_keys())
MAX_EXPOSURE = 3.0


def systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        pytest.skip("systemd-analyze not installed (apt-get install systemd)")
    return path


def daemon_executable() -> Path:
    found = shutil.which("moshpitd")
    if found is not None:
        return Path(found)
    return Path(sys.executable).parent / "moshpitd"


def unit_with_local_exec(tmp_path: Path) -> Path:
    """The unit with ExecStart pointing at the installed daemon (verify checks it exists)."""
    text = UNIT.read_text()
    exec_lines = re.findall(r"^ExecStart=(\S+)(.*)$", text, flags=re.MULTILINE)
    assert len(exec_lines) == 1, exec_lines
    binary, arguments = exec_lines[0]
    assert binary == "/usr/local/bin/moshpitd"
    assert arguments.split() == ["--config", "/etc/moshpitd/moshpitd.toml"]
    exe = daemon_executable()
    assert exe.exists(), f"{exe} missing: install the package (pip install -e .)"
    copy = tmp_path / "moshpitd.service"
    copy.write_text(text.replace(f"ExecStart={binary}", f"ExecStart={exe}"))
    return copy


def unit_settings() -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def test_unit_settings() -> None:
    s = unit_settings()
    assert s["Type"] == ["simple"]
    assert s["DynamicUser"] == ["yes"]
    assert s["RuntimeDirectory"] == ["moshpitd"]
    assert s["ConfigurationDirectory"] == ["moshpitd"]
    assert s["Restart"] == ["on-failure"]
    assert s["KillSignal"] == ["SIGTERM"]
    assert float(s["TimeoutStopSec"][0]) > 10.0  # the daemon's default drain_timeout
    assert s["CapabilityBoundingSet"] == [""]
    assert s["ProtectSystem"] == ["strict"]
    assert s["RestrictAddressFamilies"] == ["AF_UNIX AF_INET AF_INET6"]
    assert "IPAddressDeny" not in s and "IPAddressAllow" not in s  # peers can be anywhere


def test_systemd_verify(tmp_path: Path) -> None:
    tool = systemd_analyze()
    unit = unit_with_local_exec(tmp_path)
    proc = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True,
                          timeout=60, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    # verify may complain about other units of the machine; none may concern ours.
    ours = [line for line in output.splitlines() if "moshpitd" in line]
    assert not ours, "\n".join(ours)


def test_systemd_security_exposure() -> None:
    tool = systemd_analyze()
    proc = subprocess.run([tool, "security", "--offline=yes", "--no-pager", str(UNIT)],
                          capture_output=True, text=True, timeout=60, check=False)
    output = proc.stdout + proc.stderr
    match = re.search(r"Overall exposure level for moshpitd\.service: (\d+(?:\.\d+)?)", output)
    assert match, output
    assert float(match.group(1)) <= MAX_EXPOSURE, output


def check_config_keys(config: dict[str, Any]) -> None:
    unknown = set(config) - CONFIG_KEYS
    assert not unknown, f"keys the daemon rejects: {sorted(unknown)}"


def test_example_config() -> None:
    with CONFIG.open("rb") as f:
        config = tomllib.load(f)
    check_config_keys(config)
    assert set(config) == CONFIG_KEYS  # the example documents every key
    assert config["ipc_socket"] == "/run/moshpitd/moshpitd.sock"
    assert config["log_level"] in {"DEBUG", "INFO", "WARNING", "ERROR"}
    assert config["log_format"] in {"text", "json"}
    assert 4096 <= config["part_size"] <= 64 << 20
    assert config["drain_timeout"] < 30  # TimeoutStopSec of the unit
    assert all(isinstance(a, str) and ":" in a for a in config["bootstrap"])


def has_check_config() -> bool:
    return "--check-config" in build_parser().format_help()


def check_config(path: Path, env: dict[str, str] | None = None) -> None:
    """Run the daemon's own validation on a config file, with only `env` as MOSHPITD_* vars."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MOSHPITD_")}
    environ.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-m", "moshpitd.cli", "--check-config", "--config", str(path)],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=environ, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


needs_check_config = pytest.mark.skipif(not has_check_config(),
                                        reason="moshpitd has no --check-config yet")


@needs_check_config
def test_example_config_accepted_by_daemon() -> None:
    check_config(CONFIG)


def manifest_documents() -> list[dict[str, Any]]:
    with MANIFEST.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc]


def one_of_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d.get("kind") == kind]
    assert len(found) == 1, f"{len(found)} objects of kind {kind}"
    return found[0]


def test_kubernetes_manifest() -> None:
    docs = manifest_documents()
    ds = one_of_kind(docs, "DaemonSet")
    service = one_of_kind(docs, "Service")
    configmap = one_of_kind(docs, "ConfigMap")

    assert service["spec"]["clusterIP"] == "None"
    namespace = service["metadata"]["namespace"]
    template = ds["spec"]["template"]
    labels = template["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
    assert ds["spec"]["selector"]["matchLabels"].items() <= labels.items()

    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "9464"
    assert annotations["prometheus.io/path"] == "/metrics"

    pod = template["spec"]
    assert pod["terminationGracePeriodSeconds"] > 10.0
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == 7701, probe
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert "add" not in security["capabilities"]

    ports = {(p["containerPort"], p.get("protocol", "TCP")) for p in container["ports"]}
    assert {(7700, "UDP"), (7701, "TCP"), (7702, "TCP"), (9464, "TCP")} <= ports

    env = {e["name"]: e for e in container["env"]}
    assert env["MOSHPITD_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    bootstrap = env["MOSHPITD_BOOTSTRAP"]["value"]
    assert bootstrap == f"{service['metadata']['name']}.{namespace}.svc.cluster.local:7700"

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/run/moshpitd"]]["hostPath"]["path"] == "/run/moshpitd"
    assert volumes[mounts["/etc/moshpitd"]]["configMap"]["name"] == configmap["metadata"]["name"]

    config = tomllib.loads(configmap["data"]["moshpitd.toml"])
    check_config_keys(config)
    assert config["metrics_listen"] == "0.0.0.0:9464"
    assert config["ipc_socket"] == "/run/moshpitd/moshpitd.sock"
    assert config["dht_listen"].endswith(":7700")
    assert config["grpc_listen"].endswith(":7701")
    assert config["data_port"] == 7702
    assert config["drain_timeout"] < pod["terminationGracePeriodSeconds"]
    assert container["command"][-2:] == ["--config", "/etc/moshpitd/moshpitd.toml"]
    # Service links would put MOSHPITD_*_SERVICE_HOST in the environment: the daemon refuses.
    assert pod["enableServiceLinks"] is False


@needs_check_config
def test_kubernetes_config_accepted_by_daemon(tmp_path: Path) -> None:
    docs = manifest_documents()
    configmap = one_of_kind(docs, "ConfigMap")
    (container,) = one_of_kind(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    path = tmp_path / "moshpitd.toml"
    path.write_text(configmap["data"]["moshpitd.toml"])
    env = {e["name"]: e.get("value", "10.244.1.7") for e in container["env"]}  # podIP example
    check_config(path, env)


@pytest.mark.parametrize("path", sorted((DEPLOY / "kubernetes").glob("*.y*ml")),
                         ids=lambda p: p.name)
def test_every_manifest_parses(path: Path) -> None:
    with path.open() as f:
        docs = [doc for doc in yaml.safe_load_all(f) if doc]
    assert docs, f"{path} holds no objects"
    for doc in docs:
        assert isinstance(doc, dict), f"{path}: a document is not a mapping"
        assert doc.get("apiVersion") and doc.get("kind"), doc
        assert doc.get("metadata", {}).get("name"), f"{path}: a {doc['kind']} without a name"


def test_kubernetes_ports_and_mounts_follow_the_config() -> None:
    """The probes, ports, annotations and mounts name what the ConfigMap's daemon binds."""
    docs = manifest_documents()
    (namespace,) = [d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"]
    for doc in docs:
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == namespace, doc["metadata"]
    ds = one_of_kind(docs, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == one_of_kind(docs, "ServiceAccount")["metadata"]["name"]
    config = tomllib.loads(one_of_kind(docs, "ConfigMap")["data"]["moshpitd.toml"])

    def port(hostport: str) -> int:
        return int(hostport.rpartition(":")[2])

    (container,) = pod["containers"]
    named = {p["name"]: (p["containerPort"], p.get("protocol", "TCP"))
             for p in container["ports"]}
    assert named["dht"] == (port(config["dht_listen"]), "UDP")
    assert named["grpc"] == (port(config["grpc_listen"]), "TCP")
    assert named["data"] == (config["data_port"], "TCP")
    assert named["metrics"] == (port(config["metrics_listen"]), "TCP")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == named["grpc"][0], probe
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == named["metrics"][0]

    service = one_of_kind(docs, "Service")
    for p in service["spec"]["ports"]:
        assert p["targetPort"] in named, p
        assert (p["port"], p.get("protocol", "TCP")) == named[p["targetPort"]], p

    volumes = {v["name"] for v in pod["volumes"]}
    for c in pod.get("initContainers", []) + pod["containers"]:
        for mount in c.get("volumeMounts", []):
            assert mount["name"] in volumes, (c["name"], mount)
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    config_path = container["command"][container["command"].index("--config") + 1]
    assert str(Path(config_path).parent) in mounts, config_path
    assert str(Path(config["ipc_socket"]).parent) in mounts, config["ipc_socket"]
    assert not mounts[str(Path(config["ipc_socket"]).parent)].get("readOnly", False)
