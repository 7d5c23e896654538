"""A small emulated network for integration tests: hosts in Linux network namespaces on one
bridge, each link capped with `tc tbf`, losing packets at random with nftables, and delayed by
a transparent userspace proxy (this kernel has no `netem`).

Layout (names carry a random tag, so runs never collide and nothing is created in the root
namespace):

    <tag>-sw    the "switch": a bridge `br0` with ports p1..pN
    <tag>-h1..  one namespace per host: `eth0` (10.A.B.i/24), the other end of veth pI

Per host:
  * bandwidth: `tbf` at `rate` on both ends of its veth (host upload and download);
  * loss: an nftables rule on input from `eth0`, `numgen random mod 100 < loss_pct drop`;
  * latency: an nftables `tproxy` rule hands every TCP connection and UDP datagram arriving on
    `eth0` to a delayer process running in the namespace (`python tests/netns.py delay ...`).
    TCP: the delayer accepts the connection in place of its real destination, connects to the
    original address over loopback, and forwards each direction's bytes `delay` seconds after
    reading them (so request/response round trips get 2 x delay). UDP: it re-sends each
    datagram `delay` seconds later from a transparent socket bound to the original source
    address, so the receiver still sees the sender's real address (Kademlia uses it as the
    contact's address); a reply is delayed the same way on the other host. Every host-to-host
    round trip, TCP or UDP, is therefore about 2 x delay longer.

Daemons bind their host's address directly (no port games): the interception is invisible to
them. Run as `python tests/netns.py delay|ping ...` inside a namespace for the helper processes.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from moshpitd.launcher import DaemonProcess

SOL_IP = 0
IP_TRANSPARENT = 19
IP_RECVORIGDSTADDR = 20
IP_ORIGDSTADDR = 20

PROXY_PORT = 7800  # where tproxy hands intercepted traffic (TCP and UDP)
DHT_PORT, GRPC_PORT, DATA_PORT = 7700, 7701, 7702  # one daemon per namespace: fixed ports
ECHO_PORT = 7799  # a TCP and UDP echo service in each host, to measure round trips
HOST_IFACE = "eth0"


# --------------------------------------------------------------------------------------------
# Test-side: building and tearing down the topology
# --------------------------------------------------------------------------------------------

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
                host.exec_args(sys.executable, str(Path(__file__).resolve()), "delay",
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
            src.exec_args(sys.executable, str(Path(__file__).resolve()), "ping",
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


# --------------------------------------------------------------------------------------------
# Namespace-side: the delaying transparent proxy and the round-trip probe
# --------------------------------------------------------------------------------------------

HIGH_WATER = 4 << 20  # bytes queued per direction before reading pauses
LOW_WATER = 1 << 20


class _Direction:
    """Bytes read from `src`, written to `dst` `delay` seconds after they were read, in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop, delay: float) -> None:
        self.loop = loop
        self.delay = delay
        self.src: asyncio.Transport | None = None
        self.dst: asyncio.Transport | None = None
        self.queue: collections.deque[tuple[float, bytes | None]] = collections.deque()
        self.queued = 0
        self.timer: asyncio.TimerHandle | None = None
        self.src_paused = False
        self.done = False  # EOF delivered
        self.on_done: list[Callable[[], None]] = []

    def push(self, data: bytes | None) -> None:
        """Queue bytes, or None for end of stream."""
        self.queue.append((self.loop.time() + self.delay, data))
        self.queued += len(data or b"")
        self._schedule()
        self.flow()

    def _schedule(self) -> None:
        if self.timer is None and self.queue and self.dst is not None:
            self.timer = self.loop.call_at(self.queue[0][0], self._flush)

    def _flush(self) -> None:
        self.timer = None
        now = self.loop.time()
        while self.queue and self.queue[0][0] <= now and self.dst is not None:
            _, data = self.queue.popleft()
            self.queued -= len(data or b"")
            if data is None:
                self.done = True
                if self.dst.is_closing():
                    pass
                elif self.dst.can_write_eof():
                    self.dst.write_eof()
                else:
                    self.dst.close()
                for cb in self.on_done:
                    cb()
            elif not self.dst.is_closing():
                self.dst.write(data)
        self._schedule()
        self.flow()

    def flow(self) -> None:
        if self.src is None or self.src.is_closing():
            return
        pending = self.queued + (self.dst.get_write_buffer_size() if self.dst else 0)
        if pending > HIGH_WATER and not self.src_paused:
            self.src_paused = True
            self.src.pause_reading()
        elif pending < LOW_WATER and self.src_paused:
            self.src_paused = False
            self.src.resume_reading()


class _Side(asyncio.Protocol):
    """One TCP connection of a proxied pair; `incoming` carries what it receives."""

    def __init__(self, incoming: _Direction, outgoing: _Direction) -> None:
        self.incoming = incoming
        self.outgoing = outgoing

    def data_received(self, data: bytes) -> None:
        self.incoming.push(data)

    def eof_received(self) -> bool:
        self.incoming.push(None)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.incoming.done:
            self.incoming.push(None)

    def pause_writing(self) -> None:
        pass

    def resume_writing(self) -> None:
        self.outgoing.flow()


class _Pair:
    def __init__(self, loop: asyncio.AbstractEventLoop, delay: float) -> None:
        self.forward = _Direction(loop, delay)  # client -> server
        self.backward = _Direction(loop, delay)  # server -> client
        self.client = _Side(self.forward, self.backward)
        self.server = _Side(self.backward, self.forward)
        self.forward.on_done.append(self._maybe_close)
        self.backward.on_done.append(self._maybe_close)

    def _maybe_close(self) -> None:
        if self.forward.done and self.backward.done:
            for d in (self.forward, self.backward):
                if d.dst is not None:
                    d.dst.close()


class _Intercepted(asyncio.Protocol):
    """An intercepted connection; its socket's local address is the original target."""

    def __init__(self, loop: asyncio.AbstractEventLoop, delay: float) -> None:
        self.loop = loop
        self.delay = delay
        self.pair = _Pair(loop, delay)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        transport.pause_reading()
        self.pair.forward.src = transport
        self.pair.backward.dst = transport
        target = transport.get_extra_info("sockname")
        self.loop.create_task(self._connect(transport, target[0], target[1]))

    async def _connect(self, client: asyncio.Transport, host: str, port: int) -> None:
        try:
            server, _ = await self.loop.create_connection(lambda: self.pair.server, host, port)
        except OSError:
            client.abort()
            return
        self.pair.forward.dst = server
        self.pair.backward.src = server
        self.pair.forward._schedule()
        self.pair.backward._schedule()
        if not client.is_closing():
            client.resume_reading()

    def data_received(self, data: bytes) -> None:
        self.pair.client.data_received(data)

    def eof_received(self) -> bool:
        return self.pair.client.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.pair.client.connection_lost(exc)

    def resume_writing(self) -> None:
        self.pair.client.resume_writing()


class _UdpDelayer:
    """Re-sends intercepted datagrams `delay` seconds later, from their original source."""

    def __init__(self, loop: asyncio.AbstractEventLoop, delay: float, port: int) -> None:
        self.loop = loop
        self.delay = delay
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(SOL_IP, IP_TRANSPARENT, 1)
        self.sock.setsockopt(SOL_IP, IP_RECVORIGDSTADDR, 1)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.bind(("0.0.0.0", port))
        self.sock.setblocking(False)
        self.senders: dict[tuple[str, int], socket.socket] = {}
        loop.add_reader(self.sock.fileno(), self._readable)

    def _readable(self) -> None:
        while True:
            try:
                data, ancdata, _, src = self.sock.recvmsg(65535, socket.CMSG_SPACE(16))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                continue
            dst = None
            for level, kind, raw in ancdata:
                if level == SOL_IP and kind == IP_ORIGDSTADDR:
                    port, addr = struct.unpack_from("!2xH4s", raw)
                    dst = (socket.inet_ntoa(addr), port)
            if dst is not None:
                self.loop.call_at(self.loop.time() + self.delay, self._send, data, src, dst)

    def _send(self, data: bytes, src: tuple[str, int], dst: tuple[str, int]) -> None:
        sock = self.senders.get(src)
        if sock is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.setsockopt(SOL_IP, IP_TRANSPARENT, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            try:
                sock.bind(src)
            except OSError:
                sock.close()
                return
            sock.setblocking(False)
            self.senders[src] = sock
        with contextlib.suppress(OSError):
            sock.sendto(data, dst)


class _Echo(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)


class _UdpEcho(asyncio.DatagramProtocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.transport.sendto(data, addr)


async def _serve_delayer(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.setsockopt(SOL_IP, IP_TRANSPARENT, 1)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind(("0.0.0.0", args.port))
    tcp.listen(512)
    server = await loop.create_server(lambda: _Intercepted(loop, args.delay), sock=tcp)
    _UdpDelayer(loop, args.delay, args.port)
    echo_host, echo_port = args.echo.rsplit(":", 1)
    await loop.create_server(_Echo, echo_host, int(echo_port))
    await loop.create_datagram_endpoint(_UdpEcho, local_addr=(echo_host, int(echo_port)))
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    Path(args.ready).write_text("ready\n")
    await stop.wait()
    server.close()


def _ping(target: str, count: int) -> dict[str, float]:
    host, port_s = target.rsplit(":", 1)
    port = int(port_s)
    tcp_times: list[float] = []
    start = time.monotonic()
    conn = socket.create_connection((host, port), timeout=5)
    connect_ms = (time.monotonic() - start) * 1000
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for i in range(count + 1):
        start = time.monotonic()
        conn.sendall(bytes([i % 256]))
        conn.recv(1)
        if i:  # the first one also pays for the proxy's connection to the target
            tcp_times.append((time.monotonic() - start) * 1000)
    conn.close()
    udp_times: list[float] = []
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.settimeout(1.0)
    for i in range(count * 2):
        if len(udp_times) >= count:
            break
        start = time.monotonic()
        udp.sendto(i.to_bytes(4, "big"), (host, port))
        try:
            while udp.recv(16) != i.to_bytes(4, "big"):
                pass
        except TimeoutError:
            continue  # lost
        udp_times.append((time.monotonic() - start) * 1000)
    return {"tcp_connect_ms": connect_ms,
            "tcp_rtt_ms": statistics.median(tcp_times),
            "udp_rtt_ms": statistics.median(udp_times) if udp_times else float("nan")}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    delay = sub.add_parser("delay", help="run the delaying transparent proxy in this namespace")
    delay.add_argument("--delay", type=float, required=True, help="seconds per direction")
    delay.add_argument("--port", type=int, default=PROXY_PORT)
    delay.add_argument("--echo", required=True, help="HOST:PORT for the TCP and UDP echo")
    delay.add_argument("--ready", required=True, help="file written once listening")
    ping = sub.add_parser("ping", help="time round trips to a host's echo service")
    ping.add_argument("target")
    ping.add_argument("--count", type=int, default=10)
    args = parser.parse_args(argv)
    if args.cmd == "delay":
        try:
            import uvloop
            uvloop.install()
        except ImportError:
            pass
        asyncio.run(_serve_delayer(args))
        return 0
    print(json.dumps(_ping(args.target, args.count)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
