"""DiLoCo in moshpit.Optimizer against a fake client: the fragment schedule, error feedback, the
outer step, delay and mix, failures, and the state joiners download."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import moshpit
from moshpit import AllreduceFailed, RoundInfo
from moshpit.error_feedback import ErrorFeedback
from moshpit.fragments import FragmentSchedule, split_fragments
from moshpitd.allreduce.codecs import get_codec
from moshpitd.allreduce.layout import Run, plan_parts


@dataclass
class FakeClient:
    """Records each round; the "group's mean" is `result(tensors)` (default: what was sent)."""

    result: Callable[[list[torch.Tensor]], list[torch.Tensor]] = lambda ts: ts
    errors: list[Exception] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    published: dict[str, Any] = field(default_factory=dict)
    step_of: Callable[[], int] = lambda: -1
    last_round: RoundInfo | None = None

    def share(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [t.clone() for t in tensors]

    def average(self, tensors: Sequence[torch.Tensor], key: str, weight: float = 1.0,
                **kwargs: Any) -> list[torch.Tensor]:
        sent = [t.clone() for t in tensors]
        self.calls.append({"key": key, "weight": weight, "sent": sent, "step": self.step_of(),
                           **kwargs})
        if self.errors:
            raise self.errors.pop(0)
        return [r.clone() for r in self.result(sent)]

    def publish_state(self, key: str, tensors: Sequence[torch.Tensor], meta: dict[str, Any],
                      version: int, timeout: float) -> int:
        self.published = {"key": key, "tensors": [t.clone() for t in tensors], "meta": meta}
        return version

    def download_state(self, key: str, timeout: float
                       ) -> tuple[list[torch.Tensor], dict[str, Any]]:
        return self.published["tensors"], self.published["meta"]


def model4() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3)).double()  # 4 tensors: 30, 5, 15, 3


def make(model: nn.Module, fake: FakeClient, **kwargs: Any) -> moshpit.Optimizer:
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    opt = moshpit.Optimizer(inner, client=fake, key="run", outer_optimizer=outer, **kwargs)
    fake.step_of = lambda: opt.local_step
    return opt


def constant_step(model: nn.Module, opt: moshpit.Optimizer, grad: float = 1.0,
                  batch_size: int = 1) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, grad)
    opt.step(batch_size=batch_size)


# --- the fragment schedule ---------------------------------------------------------------------
@pytest.mark.parametrize(("every", "fragments"), [(12, 4), (10, 3), (5, 5), (7, 1), (100, 8)])
def test_each_fragment_syncs_once_per_h_steps_staggered(every: int, fragments: int) -> None:
    schedule = FragmentSchedule(every, fragments)
    due = {s: schedule.due(s) for s in range(1, 4 * every)}
    for start in range(1, 3 * every):  # any H consecutive steps
        seen = [p for s in range(start, start + every) for p in due[s]]
        assert sorted(seen) == list(range(fragments)), (start, seen)
    first = [min(s for s, ps in due.items() if p in ps) % every for p in range(fragments)]
    gaps = np.diff([*first, every])
    assert first == sorted(set(first)) and gaps.max() - gaps.min() <= 1, first  # spread evenly
    assert all(not (s - p * every // fragments) % every for s, ps in due.items() for p in ps)


def test_fragments_are_consecutive_and_about_equal() -> None:
    sizes = [100, 3, 50, 50, 7, 90, 10, 100, 1]
    frags = split_fragments(sizes, 3)
    assert [i for f in frags for i in f] == list(range(len(sizes)))
    totals = [sum(sizes[i] for i in f) for f in frags]
    assert max(totals) - min(totals) <= 100, totals  # never worse than one tensor
    with pytest.raises(ValueError, match="at least 4 parameter tensors"):
        split_fragments([1, 2, 3], 4)


def test_optimizer_syncs_fragments_under_their_keys_on_schedule() -> None:
    model, fake = model4(), FakeClient()
    opt = make(model, fake, average_every=8, fragments=4)
    for _ in range(24):
        constant_step(model, opt)
    got = [(c["key"], c["step"]) for c in fake.calls]
    want = sorted(((f"run/f{p}", s) for p in range(4) for s in range(1, 25)
                   if (s - 2 * p) % 8 == 0), key=lambda ks: ks[1])
    assert got == want
    params = list(model.parameters())
    frags = opt.diloco.fragments if opt.diloco else []
    for c in fake.calls:  # each fragment sends its own parameters' pseudo-gradients
        p = int(c["key"][-1])
        assert [t.shape for t in c["sent"]] == [params[i].shape for i in frags[p]]
        assert c["rounds"] == 1


# --- error feedback ----------------------------------------------------------------------------
def block_step(values: Sequence[torch.Tensor], block: int, levels: int) -> np.ndarray:
    flat = torch.cat([v.reshape(-1) for v in values]).double().numpy()
    padded = np.zeros(-(-flat.size // block) * block)
    padded[:flat.size] = np.abs(flat)
    return np.repeat(padded.reshape(-1, block).max(1) / levels, block)[:flat.size]


@pytest.mark.parametrize(("codec", "block", "levels"), [("int4", 64, 7), ("int8", 256, 127)])
def test_error_feedback_sum_sent_is_within_one_round_of_the_true_sum(
        codec: str, block: int, levels: int) -> None:
    shapes = [(300,), (17, 9), (64,)]
    gen = torch.Generator().manual_seed(1)
    ef, plain = ErrorFeedback(codec), ErrorFeedback(codec)
    true_sum = np.zeros(sum(int(np.prod(s)) for s in shapes))
    sent_sum, plain_sum = true_sum.copy(), true_sum.copy()

    def flat(ts: Sequence[torch.Tensor]) -> np.ndarray:
        return torch.cat([t.reshape(-1) for t in ts]).double().numpy()

    for k in range(40):
        g = [torch.randn(s, generator=gen) * (1 + k % 3) for s in shapes]
        sent, left = ef.compress([0, 1, 2], g)
        ef.commit(left)
        quantized, _ = plain.compress([0, 1, 2], g)  # never committed: no feedback
        true_sum += flat(g)
        sent_sum += flat(sent)
        plain_sum += flat(quantized)
    wanted = [s + r for s, r in zip(sent, left.values(), strict=True)]  # the last round's input
    bound = 0.5 * block_step(wanted, block, levels) * (1 + 1e-5) + 1e-6
    err = np.abs(sent_sum - true_sum)
    assert (err <= bound).all(), (err / bound).max()
    assert np.abs(plain_sum - true_sum).max() > 3 * err.max()  # without it the error piles up


@pytest.mark.parametrize("codec", ["int4", "int8", "fp16", "bf16"])
def test_what_the_client_computes_is_what_the_parts_carry(codec: str) -> None:
    """The round encodes each part on its own; parts start on block boundaries of their run,
    so the parts carry exactly the values the trainer computed, whatever the group's shares."""
    gen = torch.Generator().manual_seed(2)
    tensors = [torch.randn(70_001, generator=gen), torch.randn(33, 31, generator=gen),
               torch.randn(5, generator=gen, dtype=torch.float64)]
    sent, _ = ErrorFeedback(codec).compress([0, 1, 2], tensors)
    c = get_codec(codec)
    runs = [Run("float32", 70_001 + 33 * 31, (0, 1)), Run("float64", 5, (2,))]
    flats = [torch.cat([sent[0].reshape(-1), sent[1].reshape(-1)]).numpy(), sent[2].numpy()]
    for shares in ([1.0, 1.0, 1.0], [0.37, 1.0, 0.0, 0.61]):
        for p in plan_parts(runs, shares, 1 << 14, c):
            values = flats[p.run][p.start:p.stop]
            carried = c.decode(c.encode(values), p.numel, values.dtype)
            assert np.array_equal(carried.astype(values.dtype), values), (codec, p)


# --- the outer step ----------------------------------------------------------------------------
def reference_outer(start: list[torch.Tensor], grads: list[list[torch.Tensor]]
                    ) -> list[torch.Tensor]:
    """torch's own SGD-Nesterov applied to the given pseudo-gradients, one step each."""
    ref = [s.clone().requires_grad_(True) for s in start]
    sgd = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=True)
    for step in grads:
        for r, g in zip(ref, step, strict=True):
            r.grad = g.clone()
        sgd.step()
    return [r.detach() for r in ref]


def test_outer_step_is_sgd_nesterov_on_the_mean_and_local_restarts_from_it() -> None:
    model = model4()
    start = [p.detach().clone() for p in model.parameters()]
    fake = FakeClient(result=lambda ts: [t * 0.5 + 0.25 for t in ts])  # "the group's mean"
    opt = make(model, fake, average_every=3)
    means = []
    for k in range(6):
        constant_step(model, opt, grad=1.0 + k, batch_size=2)
        if opt.local_step % 3 == 0:
            means.append([t * 0.5 + 0.25 for t in fake.calls[-1]["sent"]])
    assert [c["weight"] for c in fake.calls] == [6.0, 6.0]  # samples since the last sync
    want = reference_outer(start, means)
    assert opt.diloco is not None
    for g, w, p in zip(opt.diloco.global_params, want, model.parameters(), strict=True):
        torch.testing.assert_close(g.detach(), w, rtol=0, atol=1e-12)
        assert torch.equal(p.detach(), g.detach())  # local weights restarted from it
    # the pseudo-gradient of the second sync was measured from the new global copy
    first = reference_outer(start, means[:1])
    drift = 0.1 * (4 + 5 + 6)  # inner SGD lr 0.1, constant gradients 4, 5, 6
    for sent, f in zip(fake.calls[1]["sent"], first, strict=True):
        torch.testing.assert_close(sent, torch.full_like(f, drift), rtol=0, atol=1e-12)


@pytest.mark.parametrize("mix", [0.0, 0.25])
def test_delay_applies_the_update_later_and_mix_merges(mix: float) -> None:
    model = model4()
    fake = FakeClient(result=lambda ts: [torch.zeros_like(t) for t in ts])  # nobody moved
    opt = make(model, fake, average_every=4, fragments=2, delay=1, mix=mix)
    assert opt.diloco is not None
    frag0 = opt.diloco.fragments[0]  # synced at steps 4, 8..., fragment 1 at 2, 6...
    start = [p.detach().clone() for p in model.parameters()]
    want = [s.clone() for s in start]
    for step in range(1, 8):
        constant_step(model, opt)
        want = [w - 0.1 for w in want]  # inner SGD, lr 0.1, gradient 1
        # the round that started at the step before lands now (the global copy stays at the
        # start: the "mean" pseudo-gradient is 0); the one that starts now, only next step
        landed = (frag0 if step % 4 == 1 and step > 1 else
                  [i for i in range(4) if i not in frag0] if step % 4 == 3 else [])
        for i in landed:
            want[i] = mix * want[i] + (1 - mix) * start[i]
        for p, w in zip(model.parameters(), want, strict=True):
            torch.testing.assert_close(p.detach(), w, rtol=0, atol=1e-12)
    assert [c["key"] for c in fake.calls] == ["run/f1", "run/f0", "run/f1"]  # steps 2, 4, 6


def test_a_failed_round_keeps_everything_and_the_next_covers_both() -> None:
    model = model4()
    fake = FakeClient(errors=[AllreduceFailed("AllreduceError: peer died")])
    opt = make(model, fake, average_every=2, codec="int4")
    assert opt.diloco is not None and opt.diloco.feedback is not None  # on by default for int4
    start = [g.detach().clone() for g in opt.diloco.global_params]
    for _ in range(2):
        constant_step(model, opt)
    assert opt.failed_rounds == 1 and opt.rounds_done == 0
    assert all(torch.equal(g.detach(), s) for g, s in zip(opt.diloco.global_params, start,
                                                         strict=True))
    assert opt.diloco.feedback.residual == {}  # nothing was sent: no residual kept
    for _ in range(2):
        constant_step(model, opt, batch_size=3)
    assert opt.rounds_done == 1 and fake.calls[1]["weight"] == 8.0  # 2 x 1 + 2 x 3 samples
    assert torch.allclose(fake.calls[1]["sent"][1], torch.full((5,), 0.4, dtype=torch.float64),
                          atol=0.4 / 14)  # four steps of drift, through int4


def test_joiner_downloads_the_global_copy_and_outer_state() -> None:
    model, fake = model4(), FakeClient(result=lambda ts: [t + 1.0 for t in ts])
    opt = make(model, fake, average_every=2)
    for _ in range(4):
        constant_step(model, opt)
    names = fake.published["meta"]["names"]
    assert names[:4] == [f"global.{i}" for i in range(4)]
    assert names[4:] == [f"outer.{i}.momentum_buffer" for i in range(4)]
    joiner_model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3)).double()
    joiner = make(joiner_model, fake, average_every=2)
    assert joiner.load_state_from_peers.__name__  # (a fake client: load through the loop)
    assert joiner.diloco is not None and opt.diloco is not None
    assert joiner.diloco.download(fake, "run/state", 1.0) == 4  # type: ignore[arg-type]
    for a, b, p in zip(joiner.diloco.global_params, opt.diloco.global_params,
                       joiner_model.parameters(), strict=True):
        assert torch.equal(a.detach(), b.detach()) and torch.equal(p.detach(), b.detach())
        assert torch.equal(joiner.diloco.outer.state[a]["momentum_buffer"],
                           opt.diloco.outer.state[b]["momentum_buffer"])


def test_bad_options_are_refused() -> None:
    model, fake = model4(), FakeClient()
    other = nn.Linear(2, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="same parameters"):
        moshpit.Optimizer(inner, client=fake, key="k", outer_optimizer=torch.optim.SGD(
            other.parameters(), lr=0.7))
    for kwargs, match in [({"delay": 4}, "delay"), ({"fragments": 5}, "fragments"),
                          ({"mix": 1.5}, "mix"), ({"overlap": True}, "overlap")]:
        with pytest.raises(ValueError, match=match):
            make(model, fake, average_every=4, **kwargs)
    with pytest.raises(ValueError, match="need outer_optimizer"):
        moshpit.Optimizer(inner, client=fake, key="k", fragments=2)


def test_sync_is_one_outer_step_of_every_fragment() -> None:
    model = model4()
    fake = FakeClient(result=lambda ts: [t * 0 + 0.5 for t in ts])
    opt = make(model, fake, average_every=8, fragments=2, delay=1)
    for _ in range(5):
        constant_step(model, opt)  # fragment 1 synced at step 4: its round lands at step 5
    assert opt.sync(min_group_size=3, timeout=7.0)
    call = fake.calls[-1]
    assert call["key"] == "run/sync" and call["rounds"] == 1 and call["grid"] is None
    assert call["min_group_size"] == 3 and call["timeout"] == 7.0
    assert len(call["sent"]) == 4  # every parameter at once
    assert opt.rounds_done == 2 and opt.diloco is not None and not opt.diloco.pending
    for g, p in zip(opt.diloco.global_params, model.parameters(), strict=True):
        assert torch.equal(p.detach(), g.detach())


def test_grid_syncs_are_full_moshpit_all_reduces_at_one_cell() -> None:
    """On a grid every sync chains d rounds (the exact mean on a full grid), and once a round
    told us our cell, every fragment's run asks for that same cell."""
    model = model4()

    class GridClient(FakeClient):
        def average(self, tensors: Sequence[torch.Tensor], key: str, weight: float = 1.0,
                    **kwargs: Any) -> list[torch.Tensor]:
            out = super().average(tensors, key, weight, **kwargs)
            self.last_round = RoundInfo(2, 0.0, 0.0, 0, 0, round=0, coords=(1, 0))
            return out

    fake = GridClient()
    opt = make(model, fake, average_every=4, fragments=2, grid=(3, 2))
    for _ in range(8):
        constant_step(model, opt)
    assert [c["rounds"] for c in fake.calls] == [2, 2, 2, 2]
    assert [c.get("initial_coords") for c in fake.calls] == [None, (1, 0), (1, 0), (1, 0)]
    assert all(c["grid"] == (3, 2) for c in fake.calls)


def test_weights_loaded_after_building_the_optimizer_start_the_global_copy() -> None:
    model, fake = model4(), FakeClient()
    opt = make(model, fake, average_every=2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(3.0)  # a checkpoint loaded after the optimizer was built
    for _ in range(2):
        constant_step(model, opt)
    for sent in fake.calls[0]["sent"]:  # two steps of lr 0.1, gradient 1: not 3 - init
        torch.testing.assert_close(sent, torch.full_like(sent, 0.2), rtol=0, atol=1e-12)


def test_a_joiner_adds_weight_0_until_it_has_h_steps_and_a_skipped_round_steps_nothing(
        ) -> None:
    model, fake = model4(), FakeClient()
    opt = make(model, fake, average_every=4)
    for _ in range(4):
        constant_step(model, opt)
    joiner_model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3)).double()
    joiner_fake = FakeClient(published=fake.published)
    joiner = make(joiner_model, joiner_fake, average_every=4, fragments=2, codec="int4")
    assert joiner.diloco is not None and joiner.diloco.feedback is not None
    joiner.diloco.feedback.residual = {0: torch.ones(5, 6, dtype=torch.float64)}  # stale
    joiner.local_step = joiner.diloco.download(joiner_fake, "run/state", 1.0)  # type: ignore[arg-type]
    assert joiner.local_step == 4 and joiner.diloco.feedback.residual == {}
    for step in range(5, 13):  # fragment 1 syncs at steps 6 and 10, fragment 0 at 8 and 12
        constant_step(model=joiner_model, opt=joiner, batch_size=2)
        if step == 6:  # a weight-0 sync keeps no residual: its values entered no mean
            assert joiner.rounds_done == 1 and joiner.diloco.feedback.residual == {}
    assert [(c["key"], c["step"], c["weight"]) for c in joiner_fake.calls] == [
        ("run/f1", 6, 0.0), ("run/f0", 8, 8.0), ("run/f1", 10, 8.0), ("run/f0", 12, 8.0)]
    assert joiner.rounds_done == 4
    # a round whose group had only weight 0 was skipped by the daemon (every mask 0):
    # no outer step, the local weights go on, the next sync covers these steps too
    global_before = [g.detach().clone() for g in joiner.diloco.global_params]
    joiner_fake.last_round = RoundInfo(2, 0.0, 0.0, 0, 0, spans=((0, 35, 0),))
    for _ in range(2):
        constant_step(model=joiner_model, opt=joiner)
    assert joiner_fake.calls[-1]["step"] == 14 and joiner.rounds_done == 4
    assert joiner.failed_rounds == 0
    assert all(torch.equal(g.detach(), b) for g, b in zip(joiner.diloco.global_params,
                                                          global_before, strict=True))
    assert not torch.equal(next(joiner_model.parameters()).detach(), global_before[0])
