"""The systems the results benchmark compares, one module each with `run(spec, events)`.

Names only here (no imports): the orchestrator, which never imports torch, and the worker
both read them."""

MODULES = {
    "ddp": "bench.swarm.systems.ddp",
    "ddp-fp16": "bench.swarm.systems.ddp",
    "moshpit": "bench.swarm.systems.moshpit_sgd",
    "diloco-fp16": "bench.swarm.systems.moshpit_diloco",
    "diloco-int4": "bench.swarm.systems.moshpit_diloco",
    "diloco-stream": "bench.swarm.systems.moshpit_diloco",
    "hivemind-sync": "bench.swarm.systems.hivemind_opt",
    "hivemind-local": "bench.swarm.systems.hivemind_opt",
    # several trainers per host (a scenario's trainers_per_host; bench/swarm/layout.py)
    "moshpit-local": "bench.swarm.systems.moshpit_sgd",
    "moshpit-each": "bench.swarm.systems.moshpit_sgd",
}
# Systems whose hosts each run a moshpitd (the orchestrator starts it before the worker).
DAEMON_SYSTEMS = frozenset({"moshpit", "diloco-fp16", "diloco-int4", "diloco-stream",
                            "moshpit-local", "moshpit-each"})
# torch DistributedDataParallel: one world, restarted whole on a membership change.
DDP_SYSTEMS = frozenset({"ddp", "ddp-fp16"})
# hivemind 1.1.12, run from .venv-peers.
HIVEMIND_SYSTEMS = frozenset({"hivemind-sync", "hivemind-local"})
# The systems that run a scenario with trainers_per_host > 1, and only those: its default.
# The others are refused on it, so every row of such a scenario trains the same trainers.
MULTI_TRAINER_SYSTEMS = ("moshpit-local", "moshpit-each")
# What a scenario with one trainer per host runs by default: the rest.
SINGLE_TRAINER_SYSTEMS = tuple(s for s in MODULES if s not in MULTI_TRAINER_SYSTEMS)
# What --smoke runs unless --systems says otherwise: one row per kind of system (the DiLoCo
# rows share Moshpit SGD's daemon path and are checked on their own by a worker-level test,
# as is DDP's fp16 hook).
SMOKE_SYSTEMS = ("ddp", "moshpit", "hivemind-sync", "hivemind-local")
