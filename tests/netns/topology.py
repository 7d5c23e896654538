"""Test-side: building and tearing down the emulated network (see the package docstring)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tests.netns.delayer import ECHO_PORT, PROXY_PORT

if TYPE_CHECKING:
    from moshpitd.launcher import DaemonProcess

DHT_PORT, GRPC_PORT, DATA_PORT = 7700, 7701, 7702  # one daemon per namespace: fixed ports
HOST_IFACE = "eth0"
DELAYER = Path(__file__).resolve().with_name("delayer.py")  # run as a script in namespaces


def missing_prerequisites() -> str | None:
    """Why this machine cannot run the namespace tests, or None if it can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces, tc and nftables need root (CI runs these tests as root)"
    missing = [cmd for cmd in ("ip", "tc", "nft") if shutil.which(cmd) is None]
    if missing:
        return (f"missing commands: {', '.join(missing)} (Debian packages iproute2, nftables;"
                " `make system-deps` installs them)")
    return None


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(args)} failed ({proc.returncode}): "
                         f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


class NetnsError(RuntimeError):
    """A command building the topology failed (the message says which and why)."""


@dataclass
class Host:
    index: int  # 1-based
    ns: str
    ip: str
    port: str  # the switch-side veth
    delayer: subprocess.Popen[bytes] | None = None

    def exec_args(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *args]


@dataclass
class Topology:
    """N hosts on one emulated switch. Use as a context manager; `close()` removes everything
    (namespaces, and with them veths, bridge, qdiscs and nft tables; helper processes)."""

    hosts_count: int
    workdir: Path
    rate: str = "100mbit"
    loss_pct: int = 1
    delay: float = 0.025  # seconds per direction, per host-to-host hop
    tag: str = field(default_factory=lambda: "mpn" + secrets.token_hex(3))
    hosts: list[Host] = field(default_factory=list)
    daemons: list[DaemonProcess] = field(default_factory=list)
    _namespaces: list[str] = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    def __enter__(self) -> Topology:
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_ns(self, name: str) -> None:
        run("ip", "netns", "add", name)
        self._namespaces.append(name)
        run("ip", "-n", name, "link", "set", "lo", "up")

    def build(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        subnet = f"10.{secrets.randbelow(50) + 200}.{secrets.randbelow(250) + 1}"
        self._add_ns(self.switch)
        run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i in range(1, self.hosts_count + 1):
            host = Host(i, f"{self.tag}-h{i}", f"{subnet}.{i}", f"p{i}")
            self._add_ns(host.ns)
            self.hosts.append(host)
            # both ends are created straight in their namespaces: no name in the root one
            run("ip", "link", "add", HOST_IFACE, "netns", host.ns, "type", "veth",
                "peer", "name", host.port, "netns", self.switch)
            run("ip", "-n", self.switch, "link", "set", host.port, "master", "br0")
            run("ip", "-n", self.switch, "link", "set", host.port, "up")
            run("ip", "-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", HOST_IFACE)
            run("ip", "-n", host.ns, "link", "set", HOST_IFACE, "up")
            self._shape(host)
            self._nft(host)
        for host in self.hosts:
            self._start_delayer(host)
        for host in self.hosts:
            self._wait_delayer(host)

    def _shape(self, host: Host) -> None:
        # a 64 KiB bucket passes a whole GSO packet without resegmenting; ~20 ms of queue
        for ns, dev in ((host.ns, HOST_IFACE), (self.switch, host.port)):
            run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", self.rate,
                "burst", "64kb", "latency", "20ms")

    def _nft(self, host: Host) -> None:
        rules = f"""
table ip moshpit_netem {{
    chain prerouting {{
        type filter hook prerouting priority mangle; policy accept;
        iifname "{HOST_IFACE}" meta l4proto {{ tcp, udp }} tproxy to :{PROXY_PORT}
    }}
    chain input {{
        type filter hook input priority filter; policy accept;
        iifname "{HOST_IFACE}" numgen random mod 100 < {self.loss_pct} counter drop
    }}
}}
"""
        proc = subprocess.run(host.exec_args("nft", "-f", "-"), input=rules, text=True,
                              capture_output=True, timeout=30)
        if proc.returncode != 0:
            raise NetnsError(f"nft in {host.ns} failed: {proc.stderr.strip()}")

    def _start_delayer(self, host: Host) -> None:
        ready = self.workdir / f"delayer-h{host.index}.ready"
        ready.unlink(missing_ok=True)
        log = open(self.workdir / f"delayer-h{host.index}.log", "ab")  # noqa: SIM115
        try:
            host.delayer = subprocess.Popen(
                host.exec_args(sys.executable, str(DELAYER), "delay",
                               "--delay", str(self.delay), "--port", str(PROXY_PORT),
                               "--echo", f"{host.ip}:{ECHO_PORT}", "--ready", str(ready)),
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        finally:
            log.close()

    def _wait_delayer(self, host: Host, timeout: float = 20.0) -> None:
        ready = self.workdir / f"delayer-h{host.index}.ready"
        deadline = time.monotonic() + timeout
        assert host.delayer is not None
        while not ready.exists():
            if host.delayer.poll() is not None or time.monotonic() > deadline:
                log = (self.workdir / f"delayer-h{host.index}.log").read_text(errors="replace")
                raise NetnsError(f"delayer in {host.ns} did not start:\n{log}")
            time.sleep(0.02)

    def link(self, host: Host, up: bool) -> None:
        """Cut or restore a host's cable (its veth end; the switch side loses carrier too)."""
        run("ip", "-n", host.ns, "link", "set", HOST_IFACE, "up" if up else "down")

    def dropped(self, host: Host) -> int:
        """Packets the loss rule dropped so far on this host."""
        out = run(*host.exec_args("nft", "-j", "list", "chain", "ip", "moshpit_netem",
                                  "input")).stdout
        for item in json.loads(out)["nftables"]:
            for expr in item.get("rule", {}).get("expr", []):
                if "counter" in expr:
                    return int(expr["counter"]["packets"])
        return 0

    def ping(self, src: Host, dst: Host, count: int = 10) -> dict[str, float]:
        """Median TCP request/response and UDP round trips (ms) from src to dst's echo."""
        proc = subprocess.run(
            src.exec_args(sys.executable, str(DELAYER), "ping",
                          f"{dst.ip}:{ECHO_PORT}", "--count", str(count)),
            capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise NetnsError(f"ping {src.ns} -> {dst.ip} failed: {proc.stderr.strip()}")
        result: dict[str, float] = json.loads(proc.stdout)
        return result

    def start_daemon(self, host: Host, bootstrap: Sequence[Host] = (),
                     extra_args: Sequence[str] = (), wait: bool = True) -> DaemonProcess:
        """moshpitd in the host's namespace on its address (DHT 7700/udp, gRPC 7701, data
        7702); its IPC socket and ready file live in the workdir, so trainers in the root
        namespace reach it. Its log is `<workdir>/h<i>.log`."""
        from moshpitd.launcher import DaemonProcess, wait_ready

        name = f"h{host.index}"
        ready = self.workdir / f"{name}.ready.json"
        ready.unlink(missing_ok=True)
        args = host.exec_args(
            sys.executable, "-m", "moshpitd",
            "--dht-listen", f"{host.ip}:{DHT_PORT}", "--grpc-listen", f"{host.ip}:{GRPC_PORT}",
            "--data-port", str(DATA_PORT), "--metrics-listen", "127.0.0.1:0",
            "--ipc-socket", str(self.workdir / f"{name}.sock"), "--ready-file", str(ready),
            "--peer-key-file", str(self.workdir / f"{name}.peer.key"),
            *(["--bootstrap", ",".join(f"{b.ip}:{DHT_PORT}" for b in bootstrap)]
              if bootstrap else []),
            *extra_args)
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        try:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()
        daemon = DaemonProcess(name, self.workdir, proc, {"ready_file": str(ready)})
        self.daemons.append(daemon)
        if wait:
            wait_ready(daemon, timeout=30)
        return daemon

    def close(self) -> None:
        for daemon in self.daemons:  # SIGTERM all (they drain in parallel), then reap
            if daemon.alive():
                daemon.proc.send_signal(signal.SIGTERM)
        for daemon in self.daemons:
            daemon.stop(timeout=5)
        for host in self.hosts:
            if host.delayer is not None and host.delayer.poll() is None:
                host.delayer.send_signal(signal.SIGTERM)
                try:
                    host.delayer.wait(5)
                except subprocess.TimeoutExpired:
                    host.delayer.kill()
                    host.delayer.wait()
        for ns in reversed(self._namespaces):
            run("ip", "netns", "del", ns, check=False)
        self._namespaces.clear()

