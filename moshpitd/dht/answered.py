"""The DHT contacts that earned trust: node ids that answered a call of ours, one per address.

Kademlia puts the sender of any request in its routing table, and a node id costs nothing, so
being in the table says little. A contact is trusted more than a stranger (a replica answers
with its contacts' records first, a reader checks their signatures past its budget for
unproven writers, matchmaking probes their declarations first), so only an answer to one of our
calls counts. An answer proves the address, not the id: a process answering under many made-up
ids from one address holds one trusted id there, the last that answered. (Many ports still
give many: a signed proof of the id would close that.)
"""

from __future__ import annotations

from collections import OrderedDict

CAPACITY = 4096  # ids remembered (a routing table holds far fewer)

Address = tuple[str, int]


class Answered:
    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[bytes, Address] = OrderedDict()  # oldest answer first
        self._at: dict[Address, bytes] = {}

    def add(self, node_id: bytes, address: Address) -> None:
        """`node_id` answered us from `address`: the id trusted there from now on."""
        other = self._at.get(address)
        if other is not None and other != node_id:
            self._ids.pop(other, None)
        self.drop(node_id)
        self._ids[node_id] = address
        self._at[address] = node_id
        while len(self._ids) > self.capacity:
            oldest, at = self._ids.popitem(last=False)
            if self._at.get(at) == oldest:
                del self._at[at]

    def drop(self, node_id: bytes) -> None:
        """It stopped answering (the routing table dropped it)."""
        at = self._ids.pop(node_id, None)
        if at is not None and self._at.get(at) == node_id:
            del self._at[at]

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)
