"""Kademlia DHT with subkey records (docs/architecture.md, "Wire protocol")."""

from moshpitd.dht.network import DHTNode, SubRecord
from moshpitd.dht.storage import SubkeyStorage

__all__ = ["DHTNode", "SubRecord", "SubkeyStorage"]
