"""Finding a group: declarations in the DHT, a leader per group, joins over gRPC
(docs/architecture.md, "Matchmaking")."""
