"""Butterfly all-reduce: pure partitioning and reduction, plus the streaming runner."""
