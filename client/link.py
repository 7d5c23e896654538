"""The connection an optimizer averages through.

Opened at once when it can be, else at the first round; after the daemon went away the next
round opens a new connection to the same socket. Training never fails for want of a daemon:
the optimizer counts a failed round and goes on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from moshpit.client import Client
from moshpit.errors import MoshpitError
from moshpit.trainer_state import AveragingClient

log = logging.getLogger("moshpit.optimizer")
T = TypeVar("T")


class DaemonLink:
    """A client given as is (never reopened unless it is a moshpit.Client, whose socket we
    know), or a socket path this link connects to and owns."""

    def __init__(self, client: AveragingClient | str, key: str) -> None:
        self.socket_path: str | None = None
        if isinstance(client, str):
            self.socket_path = client
        elif isinstance(client, Client):
            self.socket_path = client.socket_path
        self.owns = isinstance(client, str)
        self.client: AveragingClient | None = None if isinstance(client, str) else client
        self.broken = isinstance(client, str)  # the next round (re)connects first
        if isinstance(client, str):
            try:
                self.client = Client(client)
                self.broken = False
            except MoshpitError as exc:  # not a round yet: just say so, retry at the first one
                log.warning("moshpit %s: cannot reach the daemon yet: %s", key, exc)

    def connect(self) -> bool:
        """Reopens the connection if it broke. True when a new client replaced the old one
        (memory shared with the old connection is gone); raises MoshpitError when the daemon
        cannot be reached."""
        if not self.broken:
            return False
        if self.socket_path is None:  # not ours to reopen (a fake client): just retry it
            self.broken = False
            return False
        old = self.client
        self.client = Client(self.socket_path)
        if isinstance(old, Client):
            old.close()
        self.owns = True
        self.broken = False
        return True

    def close(self) -> None:
        if self.owns and isinstance(self.client, Client):
            self.client.close()
        self.client = None


def in_background(fn: Callable[[], T], name: str) -> Future[T]:
    """Runs fn on a daemon thread; its result or exception lands in the future (handed to
    the training thread, which decides what a failure means)."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
