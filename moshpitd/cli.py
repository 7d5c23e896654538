"""`moshpitd`: parse flags, start every layer, write the ready file, stop cleanly on signals."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Sequence

from moshpitd import __version__
from moshpitd.ipc.server import IPCServer
from moshpitd.metrics import Metrics, MetricsServer
from moshpitd.node import MoshpitNode, NodeConfig, format_hostport

log = logging.getLogger("moshpitd")


def parse_hostport(text: str) -> tuple[str, int]:
    """host:port, [v6]:port; port 0 means any free port."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        number = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"port of {text!r} is not a number") from None
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"port {number} is out of range")
    return host, number


def parse_bootstrap(text: str) -> list[tuple[str, int]]:
    return [parse_hostport(part.strip()) for part in text.split(",") if part.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moshpitd", description="Moshpit All-Reduce daemon")
    p.add_argument("--dht-listen", type=parse_hostport, default=("127.0.0.1", 0),
                   metavar="HOST:PORT", help="UDP address of the DHT (default 127.0.0.1:0)")
    p.add_argument("--grpc-listen", type=parse_hostport, default=("127.0.0.1", 0),
                   metavar="HOST:PORT", help="TCP address for peers' streams (default 127.0.0.1:0)")
    p.add_argument("--data-port", type=int, default=0, metavar="PORT",
                   help="TCP port of the tensor data plane, on the gRPC host (default any)")
    p.add_argument("--part-size", type=int, default=1 << 20, metavar="BYTES",
                   help="bytes per streamed part (default 1 MiB; 64 KiB .. 64 MiB)")
    p.add_argument("--bandwidth", type=float, default=1.0, metavar="SHARE",
                   help="relative share of each vector this peer reduces (default 1.0)")
    p.add_argument("--client-mode", action="store_true",
                   help="this peer cannot accept connections (NAT): it never leads or reduces")
    p.add_argument("--bootstrap", type=parse_bootstrap, default=[],
                   metavar="HOST:PORT[,HOST:PORT...]", help="DHT addresses of running daemons")
    p.add_argument("--ipc-socket", default="/run/moshpitd/moshpitd.sock", metavar="PATH",
                   help="unix socket for trainers")
    p.add_argument("--metrics-listen", type=parse_hostport, default=("127.0.0.1", 9464),
                   metavar="HOST:PORT", help="Prometheus /metrics (default 127.0.0.1:9464)")
    p.add_argument("--ready-file", metavar="PATH",
                   help="write bound addresses here as JSON once listening")
    p.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], type=str.upper)
    p.add_argument("--version", action="version", version=f"moshpitd {__version__}")
    return p


def write_ready_file(path: str, info: dict[str, str]) -> None:
    """Atomic: a reader sees no file or the whole JSON, never half of it."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".ready-", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(info, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


async def serve(args: argparse.Namespace) -> int:
    config = NodeConfig(
        dht_host=args.dht_listen[0], dht_port=args.dht_listen[1],
        grpc_host=args.grpc_listen[0], grpc_port=args.grpc_listen[1],
        bootstrap=tuple(args.bootstrap), data_port=args.data_port,
        bandwidth=args.bandwidth, client_mode=args.client_mode, part_bytes=args.part_size,
    )
    metrics = Metrics()
    node = MoshpitNode(config, metrics)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await node.start()
    metrics_server = MetricsServer(metrics)
    mport = await metrics_server.start(*args.metrics_listen)
    metrics_endpoint = format_hostport(args.metrics_listen[0], mport)
    ipc = IPCServer(node, args.ipc_socket, metrics_endpoint)
    try:
        await ipc.start()
        info = {"peer_id": node.peer_id.hex(), "dht": format_hostport(*node.dht_addr),
                "grpc": node.grpc_endpoint, "data": node.data_endpoint, "ipc": args.ipc_socket,
                "metrics": metrics_endpoint}
        if args.ready_file:
            write_ready_file(args.ready_file, info)
        log.info("moshpitd %s ready: %s", __version__, json.dumps(info))
        await stop.wait()
        log.info("stopping")
    finally:
        await ipc.stop()
        await metrics_server.stop()
        await node.stop()
        if args.ready_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(args.ready_file)
    return 0


def run(coro_main: asyncio.Future[int] | object) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return int(asyncio.run(coro_main))  # type: ignore[arg-type]
    return int(uvloop.run(coro_main))  # type: ignore[arg-type]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not (1 << 12) <= args.part_size <= (64 << 20):
        parser.error("--part-size must be between 4096 and 67108864 bytes")
    if not (args.bandwidth > 0 and args.bandwidth < 1e12):
        parser.error("--bandwidth must be a positive number")
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("kademlia", "rpcudp"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        return run(serve(args))
    except OSError as exc:
        log.error("cannot start: %s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
