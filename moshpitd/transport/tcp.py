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


# A kept session (session.py) may sit idle for up to a minute between rounds. Keepalive probes
# keep the middleboxes on its path (NAT, firewalls) from forgetting it, and let the kernel
# close one whose peer vanished without a word, so the pool never hands it out: a stream sent
# on it would otherwise wait for a READY until its round's deadline.
KEEPALIVE_IDLE = 15  # s without traffic before the first probe
KEEPALIVE_INTERVAL = 5  # s between probes
KEEPALIVE_COUNT = 3  # unanswered probes before the connection is dropped


def set_keepalive(sock: socket.socket) -> None:
    """TCP keepalive on a data-plane connection, where the platform has it."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE),
                            ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
                            ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    except OSError as exc:  # the connection works without it
        log.debug("no TCP keepalive on a data connection: %s", exc)
