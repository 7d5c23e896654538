"""An on-path attacker: TCP forwarding that can alter one byte of a data-plane stream."""

from __future__ import annotations

import asyncio
import functools

from bench.attacks.loop import LoopThread
from moshpitd.transport.dataplane import HEADER, HELLO, PART


class Relay:
    """TCP forwarding from `listen_host` to `target_host`, port for port: what an on-path
    attacker sees. With `tamper` set, it flips one byte inside the next PART it relays to the
    target's data plane, on any connection (a new one, or a session kept from an earlier
    round), and records the sender index that connection's latest HELLO or ATTACH named."""

    def __init__(self, loop: LoopThread, listen_host: str, target_host: str,
                 ports: list[int], data_port: int) -> None:
        self.loop, self.data_port = loop, data_port
        self.tamper = False
        self.tampered_sender: int | None = None
        self.servers = [loop.run(asyncio.start_server(
            functools.partial(self._relay, host=target_host, port=port), listen_host, port))
            for port in ports]

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     host: str, port: int) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        data_plane = port == self.data_port
        await asyncio.gather(self._pump(reader, up_writer, data_plane),
                             self._pump(up_reader, writer), return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    frames: bool = False) -> None:
        """Forward; with `frames`, follow the data plane's frame boundaries (a header, then
        `length` bytes) to find the next PART when `tamper` is set."""
        pending = bytearray()  # bytes of a header not yet whole
        skip = 0  # payload bytes of the current frame still to pass
        sender: int | None = None
        try:
            while data := bytearray(await reader.read(1 << 16)):
                at = 0
                while frames and at < len(data):
                    if skip:
                        step = min(skip, len(data) - at)
                        at, skip = at + step, skip - step
                        continue
                    take = min(HEADER.size - len(pending), len(data) - at)
                    pending += data[at:at + take]
                    at += take
                    if len(pending) < HEADER.size:
                        break
                    kind, _, _, _, length, aux = HEADER.unpack(pending)
                    pending.clear()
                    skip = length
                    if kind == HELLO:
                        sender = aux
                    elif kind == PART and self.tamper and length > 100 and at + 100 < len(data):
                        self.tamper, self.tampered_sender = False, sender
                        data[at + 100] ^= 0x01  # a byte well inside the payload
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    def close(self) -> None:
        for server in self.servers:
            server.close()
