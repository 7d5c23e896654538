"""An on-path attacker: TCP forwarding that can alter one byte of a data-plane stream."""

from __future__ import annotations

import asyncio
import functools

from bench.attacks.loop import LoopThread
from moshpitd.transport.dataplane import HEADER, HELLO


class Relay:
    """TCP forwarding from `listen_host` to `target_host`, port for port: what an on-path
    attacker sees. With `tamper` set, it flips one byte inside the first PART of the next data
    stream it relays to the target, and records the sender index of that stream's HELLO."""

    def __init__(self, loop: LoopThread, listen_host: str, target_host: str,
                 ports: list[int], data_port: int, hello_length: int) -> None:
        self.loop, self.data_port, self.hello_length = loop, data_port, hello_length
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
        flip = None
        if port == self.data_port and self.tamper:  # a byte well inside the first PART
            self.tamper, flip = False, HEADER.size + self.hello_length + HEADER.size + 100
        await asyncio.gather(self._pump(reader, up_writer, flip), self._pump(up_reader, writer),
                             return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    flip: int | None = None) -> None:
        seen = 0
        try:
            while data := bytearray(await reader.read(1 << 16)):
                if seen == 0 and flip is not None and data[0] == HELLO and len(data) >= 24:
                    self.tampered_sender = int.from_bytes(data[16:24], "little")
                if flip is not None and seen <= flip < seen + len(data):
                    data[flip - seen] ^= 0x01
                seen += len(data)
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    def close(self) -> None:
        for server in self.servers:
            server.close()
