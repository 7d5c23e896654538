"""Building, changing and tearing down the emulated network (see the package docstring)."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

from netlab.cgroup import CpuGroup, cgroup_problem
from netlab.delayer import ECHO_PORT, PROXY_PORT
from netlab.links import HOST_IFACE, LinkSpec, NetnsError, nft_rules, parse_rate, run, shape
from netlab.nat import LAN_IFACE, behind_router

if TYPE_CHECKING:
    from moshpitd.launcher import DaemonProcess

DHT_PORT, GRPC_PORT, DATA_PORT = 7700, 7701, 7702  # a namespace's first daemon
MAX_SOCKET_PATH = 100  # bytes: AF_UNIX paths end at 107 on Linux
DELAYER = Path(__file__).resolve().with_name("delayer.py")  # run as a script in namespaces


def missing_prerequisites(need_cgroup: bool = False) -> str | None:
    """Why this machine cannot run the namespace tests, or None if it can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces, tc and nftables need root (CI runs these tests as root)"
    missing = [cmd for cmd in ("ip", "tc", "nft") if shutil.which(cmd) is None]
    if missing:
        return (f"missing commands: {', '.join(missing)} (Debian packages iproute2, nftables;"
                " `make system-deps` installs them)")
    return cgroup_problem() if need_cgroup else None


@dataclass
class Host:
    index: int  # 1-based
    ns: str
    ip: str
    port: str  # the switch-side veth
    link: LinkSpec = field(default_factory=LinkSpec)
    nat: str | None = None  # None: on the switch; "preserve" or "random": behind a router
    public_ip: str = ""  # the address the world sees: its own, or its router's
    router: str = ""  # the router's namespace, when behind NAT
    delayer: subprocess.Popen[bytes] | None = None
    anchor: subprocess.Popen[bytes] | None = None  # a sleeper whose /proc shows the ns counters
    cgroup: CpuGroup | None = None

    def exec_args(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *args]


@dataclass
class Topology:
    """N hosts on one emulated switch. Use as a context manager; `close()` removes everything
    (namespaces, and with them veths, bridge, qdiscs and nft tables; cgroups; helpers).

    Every host gets `rate`/`delay`/`loss_pct` unless `links` gives one LinkSpec per host.
    With `cpu_cores` set, each host gets a CPU cgroup with that quota (see netlab.cgroup).
    `nat` gives each host None (on the switch, public) or a NAT kind (netlab.nat.NAT_KINDS):
    the host then sits behind a router namespace of its own, which masquerades it."""

    hosts_count: int
    workdir: Path
    rate: str | float = "100mbit"
    loss_pct: float = 1
    delay: float = 0.025  # seconds per direction, per host-to-host hop
    links: Sequence[LinkSpec] | None = None
    cpu_cores: float | None = None
    use_cgroups: bool = False
    nat: Sequence[str | None] | None = None
    tag: str = field(default_factory=lambda: "mpn" + secrets.token_hex(3))
    hosts: list[Host] = field(default_factory=list)
    daemons: list[DaemonProcess] = field(default_factory=list)
    _namespaces: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.links is not None and len(self.links) != self.hosts_count:
            raise ValueError(f"{len(self.links)} links for {self.hosts_count} hosts")
        if self.nat is not None and len(self.nat) != self.hosts_count:
            raise ValueError(f"{len(self.nat)} NAT kinds for {self.hosts_count} hosts")
        if self.cpu_cores is not None:
            self.use_cgroups = True

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

    def link_spec(self, i: int) -> LinkSpec:
        if self.links is not None:
            return self.links[i]
        return LinkSpec(parse_rate(self.rate), self.delay, float(self.loss_pct))

    def build(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        subnet = f"10.{secrets.randbelow(50) + 200}.{secrets.randbelow(250) + 1}"
        self._add_ns(self.switch)
        run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i in range(1, self.hosts_count + 1):
            kind = self.nat[i - 1] if self.nat is not None else None
            host = Host(i, f"{self.tag}-h{i}", f"{subnet}.{i}", f"p{i}", self.link_spec(i - 1),
                        nat=kind, public_ip=f"{subnet}.{i}")
            self._add_ns(host.ns)
            self.hosts.append(host)
            if kind is None:
                # both ends are created straight in their namespaces: no name in the root one
                run("ip", "link", "add", HOST_IFACE, "netns", host.ns, "type", "veth",
                    "peer", "name", host.port, "netns", self.switch)
                run("ip", "-n", self.switch, "link", "set", host.port, "master", "br0")
                run("ip", "-n", self.switch, "link", "set", host.port, "up")
                run("ip", "-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", HOST_IFACE)
                run("ip", "-n", host.ns, "link", "set", HOST_IFACE, "up")
            else:
                host.router = f"{self.tag}-r{i}"
                self._add_ns(host.router)
                host.ip = behind_router(host, kind, self.switch, subnet)
            self.set_rate(host, host.link.rate_mbit)
            run(*host.exec_args("nft", "-f", "-"), stdin=nft_rules(host.link, PROXY_PORT))
            host.anchor = subprocess.Popen(host.exec_args("sleep", "infinity"),
                                           stdin=subprocess.DEVNULL, start_new_session=True)
            if self.use_cgroups:
                host.cgroup = CpuGroup(f"{self.tag}-h{i}", self.cpu_cores).create()
        for host in self.hosts:
            if host.link.delay_s > 0:
                self._start_delayer(host)
        for host in self.hosts:
            if host.delayer is not None:
                self._wait_delayer(host)

    # --- changing the network at run time --------------------------------------------------
    def set_rate(self, host: Host, rate_mbit: float) -> None:
        """The host's upload and download rate (both ends of its veth), now."""
        far = (host.router, LAN_IFACE) if host.router else (self.switch, host.port)
        for ns, dev in ((host.ns, HOST_IFACE), far):
            shape(ns, dev, rate_mbit)

    def link(self, host: Host, up: bool) -> None:
        """Cut or restore a host's cable (its veth end; the switch side loses carrier too)."""
        run("ip", "-n", host.ns, "link", "set", HOST_IFACE, "up" if up else "down")

    # --- reading it -------------------------------------------------------------------------
    def counters(self, host: Host) -> tuple[int, int]:
        """(tx, rx) bytes of the host's eth0 since it was created: a file read, no process."""
        assert host.anchor is not None
        with open(f"/proc/{host.anchor.pid}/net/dev") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == HOST_IFACE:
                    fields = rest.split()
                    return int(fields[8]), int(fields[0])
        raise NetnsError(f"no {HOST_IFACE} in {host.ns}")

    def delayer_cpu_seconds(self, host: Host) -> float:
        """CPU time of the host's delayer: the emulation's cost, charged to no host."""
        if host.delayer is None:
            return 0.0
        try:
            stat = Path(f"/proc/{host.delayer.pid}/stat").read_text()
        except FileNotFoundError:
            return 0.0
        fields = stat.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

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
        """Median TCP request/response and UDP round trips (ms) from src to dst's echo (the
        echo runs in dst's delayer: dst needs a delay)."""
        proc = subprocess.run(
            src.exec_args(sys.executable, str(DELAYER), "ping",
                          f"{dst.ip}:{ECHO_PORT}", "--count", str(count)),
            capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise NetnsError(f"ping {src.ns} -> {dst.ip} failed: {proc.stderr.strip()}")
        result: dict[str, float] = json.loads(proc.stdout)
        return result

    # --- processes in hosts -----------------------------------------------------------------
    def spawn(self, host: Host, args: Sequence[str], *, stdout: int | IO[bytes] | None,
              stderr: int | IO[bytes] | None = subprocess.STDOUT,
              env: dict[str, str] | None = None, cwd: Path | None = None
              ) -> subprocess.Popen[bytes]:
        """A process in the host's namespace and (if any) its cgroup, in its own session."""
        argv = host.exec_args(*args)
        if host.cgroup is not None:
            argv = host.cgroup.join_command(argv)
        return subprocess.Popen(argv, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                                env=env, cwd=cwd, start_new_session=True)

    def kill_host(self, host: Host) -> int:
        """SIGKILL every process of the host (its cgroup): a preemption. Needs cgroups."""
        if host.cgroup is None:
            raise NetnsError("kill_host needs the topology's cgroups (cpu_cores or use_cgroups)")
        return host.cgroup.kill()

    def start_daemon(self, host: Host, bootstrap: Sequence[Host] = (),
                     extra_args: Sequence[str] = (), wait: bool = True,
                     name: str | None = None,
                     ports: tuple[int, int, int] = (DHT_PORT, GRPC_PORT, DATA_PORT)
                     ) -> DaemonProcess:
        """moshpitd in the host's namespace (and cgroup) on its address (DHT 7700/udp, gRPC
        7701, data 7702 unless `ports` says otherwise: a second daemon of the host needs its
        own); its IPC socket and ready file live in the workdir, so trainers in the root
        namespace reach it. Its log is `<workdir>/<name>.log` (name: h<i>). It bootstraps
        from the first daemon (DHT 7700) of each `bootstrap` host."""
        from moshpitd.launcher import DaemonProcess, wait_ready

        name = name or f"h{host.index}"
        ready = self.workdir / f"{name}.ready.json"
        ready.unlink(missing_ok=True)
        sock = self.workdir / f"{name}.sock"
        if len(os.fsencode(sock)) > MAX_SOCKET_PATH:  # a deep workdir (pytest's, under xdist)
            tag = hashlib.sha256(os.fsencode(self.workdir)).hexdigest()[:12]
            sock = Path(tempfile.gettempdir()) / f"netlab-{tag}-{name}.sock"
        sock.unlink(missing_ok=True)
        dht, grpc, data = ports
        args = [
            sys.executable, "-m", "moshpitd",
            "--dht-listen", f"{host.ip}:{dht}", "--grpc-listen", f"{host.ip}:{grpc}",
            "--data-port", str(data), "--metrics-listen", "127.0.0.1:0",
            "--ipc-socket", str(sock), "--ready-file", str(ready),
            "--peer-key-file", str(self.workdir / f"{name}.peer.key"),
            *(["--bootstrap", ",".join(f"{b.ip}:{DHT_PORT}" for b in bootstrap)]
              if bootstrap else []),
            *extra_args]
        with open(self.workdir / f"{name}.log", "ab") as log:
            proc = self.spawn(host, args, stdout=log)
        daemon = DaemonProcess(name, self.workdir, proc, {"ready_file": str(ready)})
        self.daemons.append(daemon)
        if wait:
            wait_ready(daemon, timeout=30)
        return daemon

    def _start_delayer(self, host: Host) -> None:
        ready = self.workdir / f"delayer-h{host.index}.ready"
        ready.unlink(missing_ok=True)
        with open(self.workdir / f"delayer-h{host.index}.log", "ab") as log:
            host.delayer = subprocess.Popen(
                host.exec_args(sys.executable, str(DELAYER), "delay",
                               "--delay", str(host.link.delay_s), "--port", str(PROXY_PORT),
                               "--echo", f"{host.ip}:{ECHO_PORT}", "--ready", str(ready)),
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)

    def _wait_delayer(self, host: Host, timeout: float = 20.0) -> None:
        ready = self.workdir / f"delayer-h{host.index}.ready"
        deadline = time.monotonic() + timeout
        assert host.delayer is not None
        while not ready.exists():
            if host.delayer.poll() is not None or time.monotonic() > deadline:
                log = (self.workdir / f"delayer-h{host.index}.log").read_text(errors="replace")
                raise NetnsError(f"delayer in {host.ns} did not start:\n{log}")
            time.sleep(0.02)

    def close(self) -> None:
        for daemon in self.daemons:  # SIGTERM all (they drain in parallel), then reap
            if daemon.alive():
                daemon.proc.send_signal(signal.SIGTERM)
        for daemon in self.daemons:
            daemon.stop(timeout=5)
        for host in self.hosts:
            if host.cgroup is not None:
                host.cgroup.remove()
            for helper in (host.delayer, host.anchor):
                if helper is not None and helper.poll() is None:
                    helper.send_signal(signal.SIGTERM)
                    try:
                        helper.wait(5)
                    except subprocess.TimeoutExpired:
                        helper.kill()
                        helper.wait()
        for ns in reversed(self._namespaces):
            run("ip", "netns", "del", ns, check=False)
        self._namespaces.clear()
