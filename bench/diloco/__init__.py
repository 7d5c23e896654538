"""bench.diloco: Moshpit DiLoCo's convergence against one process on the whole batch
(`python -m bench.diloco --help`)."""
