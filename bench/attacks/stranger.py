"""The mix's attacks by a stranger: no swarm key, so nothing it sends can be authenticated;
what it can still make a daemon do is read, parse and refuse, and hold connections open.

- grpc-junk: Join calls carrying megabytes of junk each, several at once per daemon (refused
  from their length prefix, before they are buffered)
- zero-window: raw HTTP/2 connections that open every stream a connection may, each with a
  gRPC message cut off halfway, a receive window of 0 and a socket that is never read: the
  daemon can neither finish reading nor answer (slowloris, and a writer that never drains)
- udp-junk: random datagrams of random length to the DHT port, half of them dated as a sealed
  one is (the random ones fail the kernel's filter, dht/sieve.py; the dated ones reach the
  daemon and fail their tag)
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import socket
import struct
import threading
import time
from typing import Any

import grpc

from bench.attacks import http2
from bench.attacks.dht_wire import hostport
from bench.attacks.mix import BURST_SECONDS, Attack, Env, HeldConnections
from bench.attacks.targets import Swarm, Target
from moshpitd.transport.grpc_server import JOIN, MAX_STREAMS_PER_CONNECTION


def _until() -> float:
    return time.monotonic() + BURST_SECONDS


class GrpcJunk(Attack):
    """Join calls with MESSAGE bytes of junk, CONCURRENT at a time, round-robin over daemons."""

    name = "grpc-junk"
    needs_key = False
    MESSAGE = 4 << 20
    CONCURRENT = 8
    TIMEOUT = 10.0

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        self.junk = b"\x0a" * self.MESSAGE
        self.pool = cf.ThreadPoolExecutor(self.CONCURRENT, thread_name_prefix="grpc-junk")
        self.channels: dict[str, grpc.Channel] = {}
        self.running: set[cf.Future[str]] = set()
        self.calls: set[Any] = set()
        self.lock = threading.Lock()
        self.turn = 0

    def _channel(self, endpoint: str) -> grpc.Channel:
        if endpoint not in self.channels:
            self.channels[endpoint] = grpc.insecure_channel(self.env.egress.via(endpoint), options=[
                ("grpc.max_send_message_length", 1 << 30), ("grpc.enable_retries", 0)])
        return self.channels[endpoint]

    def _call(self, endpoint: str) -> str:
        join = self._channel(endpoint).unary_stream(
            JOIN, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        call = join(self.junk, timeout=self.TIMEOUT)
        with self.lock:
            self.calls.add(call)
        try:
            for _ in call:
                pass
            return "answered"
        except grpc.RpcError as exc:
            return str(exc.code().name)
        finally:
            with self.lock:
                self.calls.discard(call)

    def step(self, swarm: Swarm) -> None:
        live = {t.grpc for t in swarm.targets}
        for gone in set(self.channels) - live:
            self.channels.pop(gone).close()
        self.env.egress.keep(live)
        targets = sorted(live)
        while targets and len(self.running) < self.CONCURRENT:
            self.turn += 1
            self.running.add(self.pool.submit(self._call, targets[self.turn % len(targets)]))
            self.counts["messages"] += 1
            self.counts["bytes"] += self.MESSAGE
        done, _ = cf.wait(self.running, BURST_SECONDS, cf.FIRST_COMPLETED)
        for f in done:
            self.running.discard(f)
            self.counts[f"answer {f.result()}"] += 1

    def stop(self) -> None:
        with self.lock:
            for call in self.calls:
                call.cancel()
        cf.wait(self.running, self.TIMEOUT)
        self.running.clear()
        for ch in self.channels.values():
            ch.close()
        self.channels.clear()
        super().stop()


class ZeroWindow(HeldConnections):
    """Up to PER_DAEMON connections to each daemon's gRPC port, each with every stream a
    connection may open carrying part of a Join message, never read."""

    name = "zero-window"
    needs_key = False
    PER_DAEMON = 128
    CLAIMED = 16_000  # under the daemon's request limit: it must wait for the rest
    SENT = 1_000  # x 64 streams: within the connection's first flow-control window (64 KiB)
    PING_EVERY = 1.0  # s: a PING on each held connection (its answer, too, is never read)

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        self.part = os.urandom(self.SENT)
        self.pinged: dict[socket.socket, float] = {}

    def endpoint(self, target: Target) -> str:
        return target.grpc

    def connect(self, endpoint: str) -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)  # the kernel's least: ~2 KiB
        s.settimeout(1.0)
        try:
            s.bind((self.env.source, 0))
            s.connect(hostport(endpoint))
        except OSError:
            s.close()
            raise
        s.setblocking(False)
        wire = [http2.PREFACE, http2.settings(initial_window_size=0)]
        wire += [http2.grpc_call(2 * i + 1, endpoint, JOIN, self.part, self.CLAIMED)
                 for i in range(MAX_STREAMS_PER_CONNECTION)]
        self._send(s, b"".join(wire))
        self.pinged[s] = time.monotonic()
        self.counts["streams"] += MAX_STREAMS_PER_CONNECTION
        return s

    def alive(self, s: socket.socket) -> bool:
        if time.monotonic() - self.pinged.get(s, 0.0) < self.PING_EVERY:
            return True
        self.pinged[s] = time.monotonic()
        if self._send(s, http2.ping()):
            return True
        del self.pinged[s]
        return False

    def _send(self, s: socket.socket, data: bytes) -> bool:
        """False if the daemon closed the connection."""
        try:
            sent = s.send(data)
            self.counts["bytes"] += sent
            if sent < len(data):
                self.counts["sends cut short (window full)"] += 1
        except BlockingIOError:
            self.counts["sends cut short (window full)"] += 1
        except OSError:
            return False
        return True

    def stop(self) -> None:
        self.pinged.clear()
        super().stop()


class UdpJunk(Attack):
    """Datagrams of 1 to 1400 bytes, round-robin over the daemons' DHT ports: random, and
    every other one starting with the current date, as a stranger who read the seal's format
    would send them."""

    name = "udp-junk"
    needs_key = False

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((env.source, 0))
        # even ones of any length, odd ones long enough to pass for a sealed datagram
        self.junk = [os.urandom(env.rng.randint(1 if i % 2 == 0 else 64, 1400))
                     for i in range(64)]

    def step(self, swarm: Swarm) -> None:
        addrs = [hostport(t.dht) for t in swarm.targets]
        date = struct.pack(">Q", int(time.time() * 1000))
        junk_now = [date + j[8:] if len(j) >= 64 and i % 2 else j
                    for i, j in enumerate(self.junk)]
        until, i = _until(), 0
        while addrs and time.monotonic() < until:
            for _ in range(64):
                i += 1
                junk = junk_now[i % len(junk_now)]
                try:
                    self.sock.sendto(junk, addrs[i % len(addrs)])
                except OSError:
                    self.counts["send errors"] += 1
                    continue
                self.counts["datagrams"] += 1
                self.counts["bytes"] += len(junk)
