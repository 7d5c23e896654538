"""Re-export of netlab.topology (the emulated network moved to the package `netlab`)."""

from netlab.topology import DATA_PORT, DELAYER, DHT_PORT, GRPC_PORT, Host, Topology
from netlab.topology import missing_prerequisites as missing_prerequisites

__all__ = ["DATA_PORT", "DELAYER", "DHT_PORT", "GRPC_PORT", "Host", "Topology",
           "missing_prerequisites"]
