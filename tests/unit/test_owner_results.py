"""Results an owner returns (allreduce/ownerlink.py) are checked before they reach the
trainer's buffer: one holding NaN or Inf leaves its part at our local values with mask 0, for
every codec and dtype, also for a part split over two tensors with a gap between them."""

from __future__ import annotations

import numpy as np
import pytest

from moshpitd.allreduce.codecs import CODECS, get_codec
from moshpitd.allreduce.group import Group, GroupMember
from moshpitd.allreduce.layout import FlatView, Part, TensorSpec
from moshpitd.allreduce.ownerlink import OwnerLink, ReadyGate
from moshpitd.allreduce.plan import Ledger, RoundPlan
from moshpitd.transport.dataplane import RESULT

FIRST, SECOND = 900, 700  # the owner's span crosses from the first tensor into the second


class NoExclusions:
    def exclude(self, sender: int, why: str, fault: str = "other") -> None:
        raise AssertionError(f"nobody is excluded here: {why}")

    def lost(self, sender: int, why: str, fault: str) -> None:
        raise AssertionError(f"nobody is lost here: {why}")


def make_link(codec: str, dtype: str) -> tuple[OwnerLink, np.ndarray]:
    size = np.dtype(dtype).itemsize
    second = (FIRST * size + 64 + 63) // 64 * 64  # a gap: the part is two pieces of memory
    buffer = memoryview(bytearray(second + SECOND * size))
    specs = [TensorSpec(dtype, (FIRST,), 0), TensorSpec(dtype, (SECOND,), second)]
    view = FlatView(buffer, specs)
    local = np.random.default_rng(0).standard_normal(FIRST + SECOND).astype(dtype)
    view.write(Part(0, 0, 0, FIRST + SECOND, 0), local)
    members = tuple(GroupMember(bytes([i]) * 20, f"e{i}", 1.0) for i in range(2))
    group = Group(b"g" * 16, "k", 0, b"s" * 16, members, codec)
    plan = RoundPlan(group, 0, view, get_codec(codec), 1 << 16)
    return OwnerLink(plan, Ledger(plan), 1, plan.by_owner[1], ReadyGate(1, 0.0),
                     NoExclusions()), local


def deliver(link: OwnerLink, part: Part, values: np.ndarray, mask: int) -> None:
    with np.errstate(all="ignore"):  # int8 scales of Inf make NaN, as a liar's would
        payload = link.plan.codec.encode(values)
    dest = link.buffer_for(RESULT, part.index, len(payload), mask)
    assert isinstance(dest, memoryview) and len(dest) >= len(payload)  # room for a header
    dest = dest[:len(payload)]
    dest[:] = payload
    link.on_frame(RESULT, part.index, dest, mask)


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_result_keeps_local_values(codec: str, dtype: str, bad: float) -> None:
    link, local = make_link(codec, dtype)
    (part,) = link.plan.by_owner[1]
    assert part.start < FIRST < part.stop
    values = local[part.start:part.stop].astype(np.float64) + 1.0
    values[len(values) // 3] = bad
    deliver(link, part, values.astype(dtype), 0b11)
    assert link.ledger.applied[part.index] == 0
    assert link.done.is_set() and link.failure is None
    np.testing.assert_array_equal(link.plan.view.read(part), local[part.start:part.stop])


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_finite_result_is_written(codec: str, dtype: str) -> None:
    link, local = make_link(codec, dtype)
    (part,) = link.plan.by_owner[1]
    values = (local[part.start:part.stop].astype(np.float64) / 2 + 1.0).astype(dtype)
    deliver(link, part, values, 0b11)
    assert link.ledger.applied[part.index] == 0b11
    codec_ = link.plan.codec
    want = codec_.decode(codec_.encode(values), values.size, np.dtype(dtype)).astype(dtype)
    np.testing.assert_array_equal(link.plan.view.read(part), want)
    np.testing.assert_array_equal(link.plan.view.read(Part(9, 0, 0, part.start, 0)),
                                  local[:part.start])


def test_a_result_after_the_round_closed_is_not_written() -> None:
    """Once the ledger closes, the trainer owns its buffer again and the part is reported as it
    stood (mask 0 here). A result arriving between the close and the end of its stream was
    once still written, so the buffer held an average where the mask said local values (the
    churn soak under attack caught it: "2500.0 != 0.0 (mask 0)")."""
    link, local = make_link("none", "float32")
    (part,) = link.plan.by_owner[1]
    link.ledger.closed = True
    deliver(link, part, local[part.start:part.stop] + 1.0, 0b11)
    assert link.ledger.mask(part.index) == 0
    np.testing.assert_array_equal(link.plan.view.read(part), local[part.start:part.stop])
