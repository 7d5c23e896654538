"""Is this daemon reachable? Found out by asking peers to dial it back (libp2p's AutoNAT).

We ask a few DHT contacts (`reach`, a DHT request): each answers with the address it saw our
request come from, then dials that address, on our own listen ports, from sockets it opens for
the purpose: a datagram to our DHT port and a connection to each of our gRPC and data ports,
each carrying the nonce we gave it. A reply to our own packets passes any NAT and proves
nothing; these come from ports we never sent to, so only a host whose ports the world can open
receives them. Public: one contact got through on all three ports, or every contact saw us at
our own address (no NAT between us: on a LAN or loopback a busy host's late dial-backs must
not make it private). Private: contacts took the request and none got through. Unknown:
nobody took it (or we know nobody yet).

The dialer's side is bounded: it dials only the address the request came from (never one the
request names) and only once that address showed it receives our answers (a cookie round
trip), at most one dial-back per requesting socket at a time, PER_IP_RATE a second per address,
DIAL_RATE a second and MAX_DIALING at once in all; a request past those is answered as
refused, and the requester does not count it. Verdicts need two contacts that agree (where
two can be asked): one lying contact can neither name our address nor make us private.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import logging
import os
import socket
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import msgpack

from moshpitd import timebase
from moshpitd.auth import SwarmKey
from moshpitd.buckets import Bucket, lru_bucket
from moshpitd.nat import wire
from moshpitd.transport.gate import REACH_MAGIC

log = logging.getLogger(__name__)

UNKNOWN, PUBLIC, PRIVATE = "unknown", "public", "private"
KINDS = ("dht", "grpc", "data")
DIALERS = 3  # contacts asked per check
WAIT = 3.0  # s for dial-backs: a lost SYN is sent again after 1 s
DIAL_TIMEOUT = 3.0
DIAL_RATE, DIAL_BURST = 16.0, 64  # dial-backs a second, over all requesters
MAX_DIALING = 64
PER_IP_RATE, PER_IP_BURST = 2.0, 32  # of them for one requesting address (peers behind a NAT,
# or on one host, share it; one address must not take every dial-back)
COOKIE_SECONDS = 30.0
UDP_COPIES = 2  # a lost datagram must not make a public peer private
NONCE = 16


@dataclass
class Verdict:
    state: str = UNKNOWN
    why: str = "not checked yet"
    observed: str = ""  # the address at least two peers (or the only one) saw us at
    at: float = 0.0  # wall time of the check
    reached: dict[str, int] = field(default_factory=dict)  # kind -> dialers that got through


# a contact and a nonce -> (the address it saw us at, whether it will dial us back), or None
Ask = Callable[[object, bytes], Awaitable[tuple[str, bool] | None]]


class Reachability:
    """Our side: checks, and the dial-backs that reach us."""

    def __init__(self) -> None:
        self.verdict = Verdict()
        self._pending: dict[bytes, set[str]] = {}
        self._heard = asyncio.Event()

    def reached(self, nonce: bytes, kind: str) -> None:
        seen = self._pending.get(bytes(nonce))
        if seen is not None:
            seen.add(kind)
            self._heard.set()

    async def check(self, contacts: Sequence[object], ask: Ask,
                    own: Sequence[str] = ()) -> Verdict:
        """Ask up to DIALERS contacts to dial us back; the verdict (the caller keeps it in
        `verdict`). `own`: the addresses we listen on."""
        nonces = {os.urandom(NONCE): c for c in contacts[:DIALERS]}
        for nonce in nonces:
            self._pending[nonce] = set()
        try:
            answers = [a for a in await asyncio.gather(*(ask(c, n) for n, c in nonces.items()))
                       if a is not None]
            # one contact's word is not enough where more can be asked: identities are free
            need = min(2, len(nonces))
            seen = Counter(ip for ip, _ in answers)
            agreed = next((ip for ip, n in seen.most_common(1) if n >= need), "")
            answered = sum(dialing for _, dialing in answers)
            mine = {h for h in own if h and not _wildcard(h)}
            direct = len(answers) >= need and set(seen) <= mine
            deadline = timebase.monotonic() + WAIT
            while (answered and not direct and not self._through(nonces)
                   and timebase.monotonic() < deadline):
                self._heard.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(deadline - timebase.monotonic()):
                        await self._heard.wait()
            reached = {k: sum(k in self._pending[n] for n in nonces) for k in KINDS}
            through = self._through(nonces)
        finally:
            for nonce in nonces:
                self._pending.pop(nonce, None)
        where = ", ".join(sorted(seen)) or "?"
        if direct:
            verdict = Verdict(PUBLIC, f"peers see us at our own address {where}: no NAT between",
                              agreed, timebase.wall(), reached)
        elif through:
            verdict = Verdict(PUBLIC, f"{through} of {answered} peers dialled us back at "
                              f"{where} on every port", agreed, timebase.wall(), reached)
        elif answered >= need:
            missing = [k for k in KINDS if not reached[k]]
            verdict = Verdict(PRIVATE, f"{answered} peers saw us at {where}; none reached our "
                              f"{'/'.join(missing)} port(s) there", agreed, timebase.wall(),
                              reached)
        else:
            verdict = Verdict(UNKNOWN, f"{answered} of {len(nonces)} peers took a reachability "
                              f"check ({need} needed; the others silent or busy)", "",
                              timebase.wall(), reached)
        return verdict

    def _through(self, nonces: dict[bytes, object]) -> int:
        return sum(self._pending[n] >= set(KINDS) for n in nonces)


def _wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


class DialBack:
    """The dialer's side: dial a requester back, within bounds. A request is dialed only
    with a cookie we gave its address a moment ago (a first request gets the cookie): a forged
    source address never sees the cookie, so nobody aims our dials at a third party."""

    def __init__(self, swarm: SwarmKey | None,
                 clock: Callable[[], float] = timebase.monotonic) -> None:
        self.swarm = swarm
        self.clock = clock
        self.bucket = Bucket(DIAL_RATE, DIAL_BURST, clock())
        self.per_ip: OrderedDict[str, Bucket] = OrderedDict()
        self.dialing: OrderedDict[tuple[str, int], asyncio.Task[None]] = OrderedDict()
        self.refused = 0
        self._secret = os.urandom(32)

    def cookie(self, sender: tuple[str, int], epoch: int | None = None) -> bytes:
        epoch = int(self.clock() // COOKIE_SECONDS) if epoch is None else epoch
        msg = f"{sender[0]}|{sender[1]}|{epoch}".encode()
        return hmac.new(self._secret, msg, hashlib.sha256).digest()[:16]

    def cookie_ok(self, sender: tuple[str, int], cookie: bytes) -> bool:
        now = int(self.clock() // COOKIE_SECONDS)
        return any(hmac.compare_digest(cookie, self.cookie(sender, e)) for e in (now, now - 1))

    def request(self, sender: tuple[str, int], nonce: bytes, ports: tuple[int, int, int]
                ) -> bool:
        """Dial the ip of `sender` (where the request came from) on (dht, grpc, data); False if
        refused."""
        now = self.clock()
        mine = lru_bucket(self.per_ip, sender[0], lambda: Bucket(PER_IP_RATE, PER_IP_BURST, now))
        if (sender in self.dialing or len(self.dialing) >= MAX_DIALING
                or not mine.take(1, now)):
            self.refused += 1
            return False
        if not self.bucket.take(1, now):
            mine.tokens += 1
            self.refused += 1
            return False
        task = asyncio.ensure_future(self._dial(sender[0], nonce, ports))
        self.dialing[sender] = task
        task.add_done_callback(lambda t: self.dialing.pop(sender, None))
        return True

    async def _dial(self, ip: str, nonce: bytes, ports: tuple[int, int, int]) -> None:
        dht, grpc, data = ports
        await asyncio.gather(self._datagram(ip, dht, nonce),
                             self._connect(ip, grpc, REACH_MAGIC + nonce),
                             self._connect(ip, data, wire.frame(self.swarm, wire.REACH, nonce)),
                             return_exceptions=True)

    async def _datagram(self, ip: str, port: int, nonce: bytes) -> None:
        request = b"\x00" + os.urandom(20) + msgpack.packb(["reached", [nonce]])
        if self.swarm is not None:
            request = self.swarm.seal(b"dht", b"dht", request)
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as sock:  # a port of its own
            sock.setblocking(False)
            for copy in range(UDP_COPIES):
                with contextlib.suppress(OSError):
                    sock.sendto(request, (ip, port))
                if copy + 1 < UDP_COPIES:
                    await asyncio.sleep(0.2)

    async def _connect(self, ip: str, port: int, first: bytes) -> None:
        async with asyncio.timeout(DIAL_TIMEOUT):
            _, writer = await asyncio.open_connection(ip, port)
        try:
            writer.write(first)
            async with asyncio.timeout(DIAL_TIMEOUT):
                await writer.drain()
        finally:
            writer.close()

    async def close(self) -> None:
        for task in list(self.dialing.values()):
            task.cancel()
        await asyncio.gather(*self.dialing.values(), return_exceptions=True)


def nonce_of(payload: bytes, swarm: SwarmKey | None) -> bytes | None:
    """The nonce of a REACH step on our data port, or None if it is no valid one."""
    try:
        nonce = wire.parse(swarm, wire.REACH, payload)
    except wire.RelayError:
        return None
    return nonce if isinstance(nonce, bytes) and len(nonce) == NONCE else None
