"""The torch-free half of a connection to a daemon: the handshake and the requests that move no
tensors (status, rounds, peers). `moshpit.Client` builds on it; the `moshpit` CLI uses it alone,
so inspecting a daemon never pays for importing torch (seconds on a loaded host)."""

from __future__ import annotations

import threading
from typing import Any

from moshpit.connection import DaemonConnection, R, decode_reply
from moshpitd.ipc import schema as wire
from moshpitd.ipc.schema import DEFAULT_TIMEOUT, LOCAL_REPLY_TIMEOUT


class DaemonControl:
    """One connection to a daemon, said hello to. Thread-safe: requests are serialised."""

    def __init__(self, socket_path: str, connect_timeout: float = 5.0) -> None:
        self.socket_path = socket_path
        self._lock = threading.Lock()
        self._conn = DaemonConnection(socket_path, connect_timeout)
        try:
            hello = self._conn.hello(connect_timeout)
        except BaseException:
            self._conn.close()
            raise
        self.peer_id: str = hello.peer_id
        self.daemon_version: str = hello.version

    def status(self) -> dict[str, Any]:
        """{"status": the daemon's state, "metrics": its /metrics address, "ipc": its socket}."""
        with self._lock:
            return wire.encode(self._call(wire.StatusRequest(), wire.StatusReply,
                                          timeout=LOCAL_REPLY_TIMEOUT))

    def rounds(self) -> list[dict[str, Any]]:
        with self._lock:
            return self._call(wire.RoundsRequest(), wire.RoundsReply,
                              timeout=LOCAL_REPLY_TIMEOUT).rounds

    def peers(self) -> dict[str, Any]:
        """{"contacts": [{peer_id, dht}], "runs": {run: [{peer_id, coords, round, grpc}]}}.
        Waits as long as a request's default timeout: the daemon looks each run up in the
        DHT."""
        with self._lock:
            reply = self._call(wire.PeersRequest(), wire.PeersReply, timeout=DEFAULT_TIMEOUT)
        return {"contacts": reply.contacts, "runs": reply.runs}

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> DaemonControl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, req: wire.Message, reply: type[R], timeout: float,
              fd: int | None = None) -> R:
        """One request; its reply decoded by field name."""
        return decode_reply(req.OP, self._request(req, timeout=timeout, fd=fd), reply)

    def _request(self, req: wire.Message, timeout: float,
                 fd: int | None = None) -> dict[str, Any]:
        return self._conn.request(req, timeout, fd)
