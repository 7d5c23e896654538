"""Benchmarks: `python -m bench.allreduce` compares moshpit's averaging with gloo's all_reduce."""
