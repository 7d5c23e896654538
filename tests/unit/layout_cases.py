"""Layouts the layout tests share: 64-byte-aligned tensor specs and hypothesis schemas."""

from __future__ import annotations

from hypothesis import strategies as st

from moshpitd.allreduce.layout import SUPPORTED_DTYPES, TensorSpec

DTYPES = sorted(SUPPORTED_DTYPES)
ALIGN = 64


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout(
    schema: list[tuple[str, tuple[int, ...]]], gap: int = 0
) -> tuple[list[TensorSpec], int]:
    """Specs at 64-byte-aligned offsets, in order, plus the buffer size that holds them."""
    specs, offset = [], 0
    for dtype, shape in schema:
        spec = TensorSpec(dtype, shape, offset)
        specs.append(spec)
        offset = align(offset + spec.nbytes) + gap * ALIGN
    return specs, max(offset, 1)


shapes = st.lists(st.integers(min_value=0, max_value=7), min_size=0, max_size=3).map(tuple)
schemas = st.lists(st.tuples(st.sampled_from(DTYPES), shapes), min_size=1, max_size=8)
shares_st = st.lists(
    st.one_of(st.just(0.0), st.floats(min_value=1e-3, max_value=1e3)), min_size=1, max_size=6
).filter(lambda s: sum(s) > 0)
