"""Attackers against real daemons, built from moshpitd's own pieces, for the regression tests
of its bounds.

- dht_wire: raw DHT datagrams, sealed with the swarm key or not; records under any peer key
- loop: an event loop of the attacker's own, in a thread
- leader: a key holder that leads a group (and may never assemble it)
- relay: an on-path TCP relay that can flip a byte
- hello: data-plane streams opened by valid HELLOs for groups nobody holds
"""
