"""Kademlia DHT with subkey records (DESIGN §3)."""

from moshpitd.dht.network import DHTNode, SubRecord
from moshpitd.dht.storage import SubkeyStorage

__all__ = ["DHTNode", "SubRecord", "SubkeyStorage"]
