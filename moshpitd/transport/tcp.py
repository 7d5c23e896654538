"""Socket settings of the data plane's TCP connections."""

from __future__ import annotations

import logging
import socket

log = logging.getLogger(__name__)

_UNAVAILABLE: set[str] = set()  # congestion controls this kernel refused (warned once each)


def set_congestion(sock: socket.socket, name: str) -> None:
    """The connection's congestion control, if the kernel has it (else its default stays)."""
    if name in _UNAVAILABLE or not hasattr(socket, "TCP_CONGESTION"):
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
    except OSError as exc:
        _UNAVAILABLE.add(name)
        log.warning("TCP congestion control %r is not available here (%s): the data plane "
                    "uses the host's default; load its module or set "
                    "data_congestion_control = system", name, exc)
