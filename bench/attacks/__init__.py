"""Attackers against real daemons, built from moshpitd's own pieces: the regression tests use
them one at a time, and `python -m bench.attacks.run` runs a rotating mix of them against a
swarm (the soak's `--attack` phase, bench/soak_attack.py).

- dht_wire: raw DHT datagrams, sealed with the swarm key or not; records under any peer key
- loop: an event loop of the attacker's own, in a thread
- leader: a key holder that leads a group (and may never assemble it)
- relay: an on-path TCP relay that can flip a byte
- hello: data-plane streams opened by valid HELLOs for groups nobody holds
- http2: raw HTTP/2 frames, for gRPC calls from a client that never reads
- egress: connections that leave from the attacker's own address
- targets: the daemons under attack, as the soak publishes them
- mix: what the attacks of the mix share; stranger, member_dht, member_groups: the attacks
  without the swarm key, and with it on the DHT and on matchmaking and the data plane
- run: the attacker process
"""
