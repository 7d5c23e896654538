"""Connections from the attacker's own address.

On loopback every process connects from 127.0.0.1, so limits a daemon keeps per remote
address would count the honest daemons and the attacker as one peer. The attacker's raw
sockets bind `source` (another loopback address, as another machine would have its own);
gRPC channels, which cannot choose their source, connect through `Egress`, a local relay whose
connections onwards leave from `source`."""

from __future__ import annotations

import asyncio
import contextlib
import functools

from bench.attacks.dht_wire import hostport
from bench.attacks.loop import LoopThread


class Egress:
    def __init__(self, loop: LoopThread, source: str) -> None:
        self.loop, self.source = loop, source
        self.servers: dict[str, asyncio.Server] = {}

    def via(self, endpoint: str) -> str:
        """A local endpoint that forwards each connection to `endpoint`, from `source`."""
        if endpoint not in self.servers:
            self.servers[endpoint] = self.loop.run(asyncio.start_server(
                functools.partial(self._relay, target=endpoint), "127.0.0.1", 0))
        port = self.servers[endpoint].sockets[0].getsockname()[1]
        return f"127.0.0.1:{port}"

    def keep(self, endpoints: set[str]) -> None:
        """Stop relaying to endpoints no longer wanted (a killed daemon's)."""
        for gone in set(self.servers) - endpoints:
            self.loop.loop.call_soon_threadsafe(self.servers.pop(gone).close)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     target: str) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(
                *hostport(target), local_addr=(self.source, 0))
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer),
                             return_exceptions=True)

    def close(self) -> None:
        self.keep(set())


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    finally:
        with contextlib.suppress(OSError):
            writer.close()
