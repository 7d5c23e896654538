"""Hypothesis strategies for values of every kind, shared by the fuzz test modules."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import strategies as st

from moshpitd.ipc.schema import MAX_FRAME

U64 = (1 << 64) - 1
I64 = -(1 << 63)

EDGE_INTS = [0, 1, -1, 2, 3, 4, 7, 63, 64, 255, 256, 1023, 1024, 1025, 4095, 4096, 65536,
             99_999, 100_000, 100_001, MAX_FRAME, MAX_FRAME + 1, 1 << 31, (1 << 32) - 1, 1 << 32,
             16 << 30, (16 << 30) + 1, (1 << 63) - 1, 1 << 63, U64, I64, I64 + 1]
ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers(-5, 5000), st.integers(I64, U64))
floats = st.one_of(st.floats(), st.sampled_from(
    [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e308, 5e-324, 1e-3, 0.05, 3600.0, 3600.5]))
texts = st.one_of(st.text(max_size=24), st.builds(
    lambda c, n: c * n, st.sampled_from(["k", "é", "\0", "/", "\U0001f600"]),
    st.sampled_from([0, 255, 256, 257, 5000, 70_000])))
blobs = st.one_of(st.binary(max_size=48), st.builds(bytes, st.sampled_from(
    [19, 20, 21, 64, 65, 1024, 1025, 70_000, 300_000])))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts, blobs)


def nested(leaves: st.SearchStrategy[Any], keys: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(leaves, lambda c: st.one_of(
        st.lists(c, max_size=4), st.dictionaries(keys, c, max_size=4)), max_leaves=8)


values = nested(scalars, st.text(max_size=8))
# umsgpack (DHT) packs the same kinds, and any hashable map key
dht_scalars = st.one_of(st.none(), st.booleans(), ints, floats, st.text(max_size=24),
                        st.binary(max_size=48), st.sampled_from([b"\0" * 20, b"x" * 1025]))
dht_values = nested(dht_scalars, st.one_of(st.text(max_size=8), st.integers(), st.binary(
    max_size=8)))


def either(*plausible: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly plausible values, sometimes anything at all."""
    return st.one_of(*plausible, *plausible, values)


# endpoints that fail fast: refused ports, unparsable, out of range (no names to resolve)
endpoints = st.one_of(
    st.sampled_from(["127.0.0.1:1", "127.0.0.1:1", "", ":", "junk", "127.0.0.1:0",
                     "127.0.0.1:99999", "[::1]:1", "[::1", "127.0.0.1:-1", "1" * 300,
                     "0.0.0.0:1", "127.0.0.1:1:2"]),
    st.text(alphabet="0123456789.:[]-", max_size=24))
