"""Requests sent again when their answer is late, as any RPC over UDP must.

rpcudp sends a request once and waits `dht_rpc_timeout` (1 s) for its answer. One lost
datagram then costs a whole timeout, and a matchmaking attempt that needed that answer waits it
out. Datagrams are lost on lossy links, and on any host whose socket buffer overflows: a
flood of junk from a stranger fills it, and the kernel drops honest datagrams with the junk.
Under such a flood, honest 4-peer rounds took 1.1 s instead of 0.07 s.

So a request not answered within its retransmission timeout is sent again, sealed afresh (a
new nonce: the receiver's replay cache would refuse the same bytes), at most RESENDS times,
each wait twice the last. The timeout is 3 smoothed round trips to that address (Karn's rule:
only answers to requests sent once are sampled), between FLOOR and a quarter of the RPC
timeout; an address never sampled waits the quarter. An answer to any copy settles the call;
a second answer finds no call and is dropped. The handlers a resent request may reach twice
are idempotent: a store of a record already held, a read, a ping.
"""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

from moshpitd import timebase

RESENDS = 2  # sends after the first, at most
FLOOR = 0.05  # s: the least retransmission timeout
GAIN = 0.125  # of a new sample in the smoothed round trip (RFC 6298's alpha)
ADDRESSES = 4096  # round trips remembered, the least recently sampled forgotten first


class Resender:
    """Tracks our requests that wait for their answers, and sends late ones again."""

    def __init__(self, send: Callable[[bytes, Any], None], waiting: dict[bytes, Any],
                 timeout: float, counts: Counter[tuple[str, str, str]]) -> None:
        """`send` seals and sends a request's bytes; `waiting` holds the msg ids of calls
        still waiting (rpcudp's `_outstanding`); `timeout` is the RPC timeout; `counts` the
        protocol's RPC counters (moshpitd_dht_rpcs), where a copy sent again counts as
        ("sent", "any", "resent")."""
        self.send, self.waiting, self.timeout, self.counts = send, waiting, timeout, counts
        self.srtt: OrderedDict[Any, float] = OrderedDict()  # address -> smoothed round trip
        # msg id -> when it was sent, while it was sent once and is unanswered (Karn's rule)
        self._sent: dict[bytes, float] = {}

    def rto(self, address: Any) -> float:
        srtt = self.srtt.get(address)
        ceiling = self.timeout / 4
        return ceiling if srtt is None else min(max(3 * srtt, FLOOR), ceiling)

    def sent(self, data: bytes, address: Any) -> None:
        """`data`, a request (its msg id at bytes 1-21), has just been sent to `address`."""
        self._sent[data[1:21]] = timebase.monotonic()
        rto = self.rto(address)
        asyncio.get_running_loop().call_later(rto, self._late, data, address, rto, RESENDS)

    def _late(self, data: bytes, address: Any, waited: float, left: int) -> None:
        msg_id = data[1:21]
        self._sent.pop(msg_id, None)  # sent again, answered, or timed out: no sample
        if msg_id not in self.waiting:
            return
        self.counts["sent", "any", "resent"] += 1
        self.send(data, address)
        if left > 1:
            asyncio.get_running_loop().call_later(2 * waited, self._late, data, address,
                                                  2 * waited, left - 1)

    def answered(self, msg_id: bytes, address: Any) -> None:
        """The answer to one of our requests came from `address`."""
        began = self._sent.pop(msg_id, None)
        if began is None:
            return
        sample = timebase.monotonic() - began
        old = self.srtt.pop(address, None)
        self.srtt[address] = sample if old is None else old + GAIN * (sample - old)
        if len(self.srtt) > ADDRESSES:
            self.srtt.popitem(last=False)
