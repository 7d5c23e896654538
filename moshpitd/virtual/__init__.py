"""A swarm of daemons in one process: the daemon's own modules on a virtual event loop
(loop.py), a virtual network (net.py, streams.py) and an in-memory control plane (control.py).
docs/architecture.md ("Simulation") names the seams."""
