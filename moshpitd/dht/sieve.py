"""A classic BPF program on the DHT socket: the kernel drops what the daemon would refuse anyway.

Every datagram the daemon reads costs it a wakeup and a Python callback (about 3 us with
uvloop) before it can look at a byte, and a flood of them takes the CPU honest rounds need.
With a swarm key, two kinds of datagram are refused whatever their content:
  - those that cannot be sealed ones: shorter than a seal, or not starting with a date in
    milliseconds since the epoch (its two top bytes are zero until the year 10,000). Random
    junk fails this in the kernel, and the kernel charges that work to the sending side when
    the sender is on this machine. Junk that copies the format still reaches the daemon and
    fails its date or tag check there;
  - those from a sender that has filled its share of the replay cache (auth.ReplayCache): the
    daemon refuses all of them until its nonces expire. The kernel refuses them instead, by
    address and port, or by address when every port of it filled the address's share, for
    BAN_SECONDS at a time, renewed while the share is still full. Such a sender proved the
    key, and a sender that spoofs another's address could already fill that address's share;
    blocking it in the kernel refuses nothing the daemon would have taken, except for the rest
    of a BAN_SECONDS after its share drains.
Only IPv4 senders are blocked by address; IPv6 ones are refused by the daemon as before.

Linux only: elsewhere, or where the kernel refuses the program, the daemon does all of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ipaddress
import logging
import socket
import struct
import sys
from collections.abc import Callable
from typing import Any

from moshpitd import timebase

log = logging.getLogger(__name__)

BAN_SECONDS = 2.0
MAX_BANS = 64  # senders blocked at once; past that, the daemon refuses them itself
SO_ATTACH_FILTER = 26
SO_MEMINFO = 55
MEMINFO_DROPS = 8  # index of SK_MEMINFO_DROPS: datagrams the socket's filter or full buffer dropped
UDP_HEADER = 8  # a UDP socket's filter sees the datagram from its UDP header
NET = -0x100000  # SKF_NET_OFF: offsets from the IP header
# opcodes (linux/filter.h)
_LD_LEN, _LD_W, _LD_H, _LD_B = 0x80, 0x20, 0x28, 0x30
_AND, _JEQ, _JGE, _RET = 0x54, 0x15, 0x35, 0x06
ACCEPT, DROP = 0xFFFFFFFF, 0


def _op(code: int, k: int = 0, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("HBBI", code, jt, jf, k & 0xFFFFFFFF)


def program(min_payload: int, bans: list[tuple[int, int | None]]) -> bytes:
    """Accept a datagram of at least `min_payload` bytes whose payload starts with two zero
    bytes, unless its IPv4 source is in `bans` ((address, port), or (address, None) for every
    port). Each ban drops with a `ret` of its own: no jump is longer than a few instructions."""
    ops = [_op(_LD_LEN), _op(_JGE, UDP_HEADER + min_payload, jt=1), _op(_RET, DROP),
           _op(_LD_H, UDP_HEADER), _op(_JEQ, 0, jt=1), _op(_RET, DROP)]
    if bans:
        ops += [_op(_LD_B, NET), _op(_AND, 0xF0), _op(_JEQ, 0x40, jt=1), _op(_RET, ACCEPT),
                _op(_LD_W, NET + 12)]
        for address, port in bans:
            if port is None:
                ops += [_op(_JEQ, address, jf=1), _op(_RET, DROP)]
            else:  # the port, then the address loaded back for the next ban
                ops += [_op(_JEQ, address, jf=3), _op(_LD_H, 0), _op(_JEQ, port, jf=1),
                        _op(_RET, DROP), _op(_LD_W, NET + 12)]
    ops.append(_op(_RET, ACCEPT))
    return b"".join(ops)


def _ipv4(host: str) -> int | None:
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address):
        addr = addr.ipv4_mapped  # type: ignore[assignment]
        if addr is None:
            return None
    return int(addr)


class Sieve:
    """The DHT socket's filter: installed once, and again whenever its blocked senders change.
    `now` is the caller's monotonic clock; expired bans leave at the next `ban` or `expire`."""

    def __init__(self, sock: socket.socket, min_payload: int,
                 still_full: Callable[[Any, bool], bool] = lambda sender, group: False) -> None:
        """`still_full(sender, whole_address)`: whether the replay cache still refuses a
        sender (or every port of its address), asked as each block ends: while it does, the
        block is renewed, and its datagrams are not let through to be refused one by one."""
        self.sock, self.min_payload, self.still_full = sock, min_payload, still_full
        # (IPv4 address, port or None) -> (blocked until, the address the daemon saw)
        self.bans: dict[tuple[int, int | None], tuple[float, Any]] = {}
        self.active = sys.platform == "linux" and self._attach()
        self._timer: asyncio.TimerHandle | None = None

    def refused(self, scope: str, sender: Any) -> None:
        """The daemon refused `sender`'s datagram for a full share (auth.ReplayFull's scope):
        block it, or its address, until its share has room."""
        if scope not in ("sender", "group"):
            return  # the whole cache is full: nobody in particular to block
        now = timebase.monotonic()
        if self.ban(sender[0], sender[1] if scope == "sender" else None, now, sender) \
                and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(BAN_SECONDS, self._tick)

    def _tick(self) -> None:
        now = timebase.monotonic()
        self.expire(now)
        due = self.next_expiry()
        self._timer = None if due is None else asyncio.get_running_loop().call_later(
            max(due - now, 0.01), self._tick)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _attach(self) -> bool:
        code = program(self.min_payload, sorted(self.bans, key=lambda b: (b[0], b[1] or 0)))
        buffer = ctypes.create_string_buffer(code)  # alive for the call: the kernel copies it
        fprog = struct.pack("HL", len(code) // 8, ctypes.addressof(buffer))
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
        except OSError as exc:
            log.info("the kernel refused the DHT socket's filter (%s): the daemon drops "
                     "malformed datagrams itself", exc)
            return False
        return True

    def ban(self, host: str, port: int | None, now: float, sender: Any = None) -> bool:
        """Blocks `host` (one `port`, or None: all of them) for BAN_SECONDS; False if it
        cannot (not IPv4, no filter, or MAX_BANS blocked already). `sender`: the address the
        daemon saw, for `still_full`."""
        address = _ipv4(host)
        if not self.active or address is None:
            return False
        key = (address, port)
        if key in self.bans and self.bans[key][0] > now:
            return True  # (its datagrams queued before the ban still come through)
        self._prune(now)
        if len(self.bans) >= MAX_BANS and key not in self.bans:
            return False
        self.bans[key] = (now + BAN_SECONDS, sender if sender is not None else (host, port or 0))
        self.active = self._attach()
        return self.active

    def expire(self, now: float) -> None:
        if self._prune(now) and self.active:
            self.active = self._attach()

    def _prune(self, now: float) -> bool:
        """Renews the blocks due whose sender is still refused, and ends the others (True if
        any ended: the filter must be loaded again)."""
        ended = False
        for key, (until, sender) in list(self.bans.items()):
            if until > now:
                continue
            if self.still_full(sender, key[1] is None):
                self.bans[key] = (now + BAN_SECONDS, sender)
            else:
                del self.bans[key]
                ended = True
        return ended

    def next_expiry(self) -> float | None:
        return min((until for until, _ in self.bans.values()), default=None)

    def dropped(self) -> int:
        """Datagrams the kernel dropped at this socket: refused by the filter, or past the
        receive buffer (the kernel counts both as one)."""
        with contextlib.suppress(OSError, struct.error):
            info = self.sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, 4 * 16)
            if len(info) >= 4 * (MEMINFO_DROPS + 1):
                return int(struct.unpack_from("I", info, 4 * MEMINFO_DROPS)[0])
        return 0
