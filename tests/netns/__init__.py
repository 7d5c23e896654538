"""The emulated network the integration tests use: it lives in the top-level package
`netlab` (shared with the results benchmark); this package re-exports it."""

from netlab import Host, NetnsError, Topology, missing_prerequisites, run

__all__ = ["Host", "NetnsError", "Topology", "missing_prerequisites", "run"]
