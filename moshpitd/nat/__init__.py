"""Peers behind NAT: reachability, relaying for others, being relayed (docs/architecture.md)."""
