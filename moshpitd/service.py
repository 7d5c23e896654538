"""The daemon's lifetime: start every layer, write the ready file, drain on SIGTERM.

Drain order matters: health goes NOT_SERVING and the IPC socket stops taking rounds first, so no
new work arrives; rounds still matching are left at once (followers released, declarations
withdrawn); rounds already averaging get `drain_timeout` to finish, so peers see a clean
departure rather than a timeout; only then do the DHT records go and the ports close.
A second signal skips the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import tempfile

from moshpitd import __version__, timebase
from moshpitd.auth import SwarmKey
from moshpitd.config import Settings
from moshpitd.hooks import NO_HOOKS, Hooks
from moshpitd.identity import PeerKey
from moshpitd.ipc.server import IPCServer
from moshpitd.metrics import Metrics, MetricsServer
from moshpitd.node import MoshpitNode, NodeConfig, format_hostport
from moshpitd.transport.security import TLSFiles

log = logging.getLogger("moshpitd")


def installed_hooks() -> Hooks:
    """The fault tests' hooks when MOSHPITD_FAULT names a fault; imported only then, so a
    production daemon never loads the fault module."""
    if not os.environ.get("MOSHPITD_FAULT"):
        return NO_HOOKS
    from moshpitd.faults import FaultPlan

    return FaultPlan.from_env()


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


def _is_wildcard(host: str) -> bool:
    try:
        return host == "" or ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def advertised_host(settings: Settings) -> str:
    """The address peers dial. A wildcard listen address cannot be dialled: use the local end
    of the route to the first bootstrap peer, or else this host's name's address."""
    if settings.advertise_host:
        return settings.advertise_host
    host = settings.grpc_listen[0]
    if not _is_wildcard(host):
        return host
    for bhost, bport in settings.bootstrap:
        try:
            family = socket.AF_INET6 if ":" in bhost else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((bhost, bport or 9))  # no packet is sent for UDP connect
                return str(probe.getsockname()[0])
        except OSError:
            continue
    address = socket.gethostbyname(socket.gethostname())
    log.warning("grpc_listen is a wildcard and no bootstrap peer is reachable: advertising %s "
                "(set advertise_host if peers cannot reach it)", address)
    return address


async def serve(settings: Settings, swarm_key: SwarmKey | None = None,
                tls: TLSFiles | None = None, identity: PeerKey | None = None) -> int:
    config = NodeConfig.of(settings, advertised_host(settings), swarm_key, tls, identity)
    if swarm_key is not None:
        log.info("swarm key fingerprint %s: only daemons with the same key are peers",
                 swarm_key.fingerprint)
    # gRPC's poller thread hands every completion to the event loop, and needs the GIL to do
    # it: while the loop's thread runs, the default 5 ms switch interval can delay each hand-off
    # that long, and joining a group is a chain of them (4 x 1M floats: median 0.032 -> 0.030 s)
    sys.setswitchinterval(0.0005)
    metrics = Metrics()
    node = MoshpitNode(config, metrics, hooks=installed_hooks())
    if node.registry.handshake.mode:
        log.info("data plane: streams encrypted (AES-256-GCM), each proven by its peer key")
    else:
        log.info("data plane: streams proven by their peer keys, not encrypted (%s)",
                 "data_encryption = off" if settings.data_encryption == "off"
                 else "no swarm key or TLS")
    signals = asyncio.Queue[int]()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    metrics_server = MetricsServer(metrics)
    ipc = IPCServer(node, settings.ipc_socket, max_sessions=settings.max_ipc_sessions)
    try:
        await node.start()
        mport = await metrics_server.start(*settings.metrics_listen)
        ipc.metrics_endpoint = format_hostport(settings.metrics_listen[0], mport)
        await ipc.start()
        info = {"peer_id": node.peer_id.hex(), "dht": format_hostport(*node.dht_addr),
                "grpc": node.grpc_endpoint, "data": node.data_endpoint,
                "ipc": settings.ipc_socket, "metrics": ipc.metrics_endpoint}
        if settings.ready_file:
            write_ready_file(settings.ready_file, info)
        log.info("moshpitd %s ready: %s", __version__, json.dumps(info))
        # What startup made (modules, gRPC, protobuf: ~40k objects) lives as long as the
        # daemon: the collector need not walk it again in every full collection mid-round.
        gc.freeze()
        await drain(node, ipc, metrics, settings.drain_timeout, signals, await signals.get())
    finally:
        await ipc.stop()
        await metrics_server.stop()
        await node.stop()
        if settings.ready_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(settings.ready_file)
    return 0


async def drain(node: MoshpitNode, ipc: IPCServer, metrics: Metrics, timeout: float,
                signals: asyncio.Queue[int], sig: int) -> None:
    start = timebase.monotonic()
    log.info("%s: draining (at most %.1f s; a second signal stops at once)",
             signal.Signals(sig).name, timeout)
    metrics.draining.set(1)
    ipc.begin_drain()
    work = asyncio.ensure_future(node.drain(timeout))
    second = asyncio.ensure_future(signals.get())
    try:
        done, _ = await asyncio.wait({work, second}, timeout=timeout + 5.0,
                                     return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            log.warning("drain cut short (%s)", "second signal" if second in done else "timeout")
    finally:
        second.cancel()
        work.cancel()
        await asyncio.gather(work, second, return_exceptions=True)
    await ipc.say_goodbye()
    log.info("drained in %.2f s; stopping", timebase.monotonic() - start)
