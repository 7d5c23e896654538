"""Local groups: a host's trainers averaging through their one daemon as one peer of the swarm,
as replicas (reduced in shared memory to one weighted mean) or as the shards of one vector."""
