"""moshpit.Optimizer against fake clients: cadence, weights, what is averaged, failures, and the
overlap mode's delta (applied whole, never from a half-written result)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import moshpit
from moshpit import AllreduceFailed, DaemonUnavailable, GroupNotFound, RoundInfo


@dataclass
class Call:
    tensors: list[torch.Tensor]  # copies of what was submitted
    weight: float
    kwargs: dict[str, Any]
    step: int  # the optimizer's local step when the round started


@dataclass
class FakeClient:
    """Same interface as moshpit.Client. `result` maps the submitted tensors to the "group's"
    mean (default: every element + 100); `errors` are raised by the next calls, in order."""

    step_of: Callable[[], int] = lambda: -1
    result: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = None
    errors: list[Exception] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    shares: int = 0
    last_round: RoundInfo | None = None

    def share(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        self.shares += 1
        return [t.clone() for t in tensors]

    def average(self, tensors: Sequence[torch.Tensor], key: str, weight: float = 1.0,
                **kwargs: Any) -> list[torch.Tensor]:
        tensors = list(tensors)
        self.calls.append(Call([t.clone() for t in tensors], weight, {"key": key, **kwargs},
                               self.step_of()))
        if self.errors:
            raise self.errors.pop(0)
        self.last_round = RoundInfo(group_size=3, seconds=0.0, matchmaking_seconds=0.0,
                                    bytes_sent=0, bytes_received=0, spans=((0, 1, 7),))
        if self.result is not None:
            return self.result(tensors)
        return [t + 100 for t in tensors]


def linear(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(3, 2).double()


def make(opt: torch.optim.Optimizer, client: FakeClient, **kwargs: Any) -> moshpit.Optimizer:
    mopt = moshpit.Optimizer(opt, client=client, key="k", **kwargs)
    client.step_of = lambda: mopt.local_step
    return mopt


def train_step(model: nn.Module, opt: moshpit.Optimizer, batch_size: int = 1) -> None:
    opt.zero_grad()
    model(torch.ones(4, 3, dtype=torch.float64)).pow(2).sum().backward()
    opt.step(batch_size=batch_size)


def test_averages_every_tau_steps_and_applies_the_result() -> None:
    model, fake = linear(), FakeClient()
    opt = make(torch.optim.SGD(model.parameters(), lr=0.01), fake, average_every=3)
    for _ in range(9):
        train_step(model, opt)
    # the round at step 9 set the params to exactly what the "group" returned
    assert torch.equal(model.weight.detach(), fake.calls[2].tensors[0] + 100)
    assert torch.equal(model.bias.detach(), fake.calls[2].tensors[1] + 100)
    train_step(model, opt)
    assert [c.step for c in fake.calls] == [3, 6, 9]
    assert opt.local_step == 10 and opt.rounds_done == 3 and opt.failed_rounds == 0
    assert opt.last_round is fake.last_round and opt.last_round is not None
    assert len(fake.calls[0].tensors) == 2  # weight and bias: no state without average_state
    assert fake.calls[0].kwargs["key"] == "k" and fake.calls[0].kwargs["grid"] is None


def test_weight_is_samples_since_the_last_successful_round() -> None:
    model = linear()
    fake = FakeClient(errors=[AllreduceFailed("AllreduceError: boom")])
    opt = make(torch.optim.SGD(model.parameters(), lr=0.01), fake, average_every=2)
    for batch in [5, 7, 3, 4, 2, 2, 10, 1]:
        train_step(model, opt, batch)
    # round 1 (12 samples) fails: its samples still count toward round 2 (12 + 7)
    assert [c.weight for c in fake.calls] == [12.0, 19.0, 4.0, 11.0]
    assert opt.failed_rounds == 1 and opt.rounds_done == 3
    assert opt.last_error is None


@pytest.mark.parametrize("average_state", [False, True])
@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    lambda ps: torch.optim.Adam(ps, lr=0.01),
    lambda ps: torch.optim.AdamW(ps, lr=0.01, amsgrad=True),
], ids=["sgd-nesterov", "adam", "adamw-amsgrad"])
def test_state_is_averaged_only_when_asked(
        average_state: bool, make_opt: Callable[[Any], torch.optim.Optimizer]) -> None:
    model, fake = linear(), FakeClient()
    inner = make_opt(model.parameters())
    opt = make(inner, fake, average_every=2, average_state=average_state)
    for _ in range(4):
        train_step(model, opt)
    params = list(model.parameters())
    float_keys = sorted(k for k, v in inner.state[params[0]].items()
                        if k != "step" and torch.is_tensor(v))
    assert float_keys  # momentum_buffer / exp_avg, exp_avg_sq (, max_exp_avg_sq)
    per_param = len(float_keys) if average_state else 0
    assert all(len(c.tensors) == 2 + 2 * per_param for c in fake.calls)
    # step counters stay local: Adam's "step" equals this peer's own local steps
    if "step" in inner.state[params[0]]:
        assert float(inner.state[params[0]]["step"]) == 4.0
    # without local steps after the round, the state holds exactly what the round returned
    if average_state:  # order: params, then per param its state in sorted key order
        last = fake.calls[-1]
        for j, key in enumerate(float_keys):
            assert torch.equal(inner.state[params[0]][key], last.tensors[2 + j] + 100)


def test_model_float_buffers_are_averaged_and_counters_are_not() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).double()
    fake = FakeClient()
    opt = make(torch.optim.SGD(model.parameters(), lr=0.01), fake, average_every=2, model=model)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(8, 3, dtype=torch.float64)).pow(2).sum().backward()
        opt.step(batch_size=8)
    (call,) = fake.calls
    n_params = len(list(model.parameters()))
    assert len(call.tensors) == n_params + 2  # running_mean, running_var
    bn = model[1]
    assert isinstance(bn, nn.BatchNorm1d)
    assert torch.equal(bn.running_mean, call.tensors[n_params] + 100)
    assert torch.equal(bn.running_var, call.tensors[n_params + 1] + 100)
    assert int(bn.num_batches_tracked) == 2  # integer buffer: local


def test_failures_keep_local_values_and_training_goes_on() -> None:
    model = linear()
    fake = FakeClient(errors=[AllreduceFailed("AllreduceError: peer died"),
                              GroupNotFound("GroupNotFound: alone"),
                              DaemonUnavailable("moshpitd closed the connection")])
    opt = make(torch.optim.SGD(model.parameters(), lr=0.01), fake, average_every=1)
    for i in range(3):
        train_step(model, opt)
        # the failed round left exactly the local values that were submitted
        assert torch.equal(model.weight.detach(), fake.calls[i].tensors[0])
    assert opt.failed_rounds == 3 and opt.rounds_done == 0
    assert isinstance(opt.last_error, DaemonUnavailable)
    train_step(model, opt)  # retried on the next step, with freshly shared buffers
    assert opt.rounds_done == 1 and len(fake.calls) == 4
    assert fake.shares == 2  # once at the first round, once after the daemon went away
    assert torch.equal(model.weight.detach(), fake.calls[3].tensors[0] + 100)


def test_other_errors_are_not_swallowed() -> None:
    model = linear()
    fake = FakeClient(errors=[TypeError("a bug, not a network failure")])
    opt = make(torch.optim.SGD(model.parameters(), lr=0.01), fake, average_every=1)
    with pytest.raises(TypeError):
        train_step(model, opt)


class GatedClient(FakeClient):
    """Blocks in average() until released; writes its result into the submitted (shared)
    tensors in place like the real client, in two halves with a pause between."""

    def __init__(self, offset: float, pause: float = 0.0,
                 write: Callable[[torch.Tensor], object] | None = None) -> None:
        super().__init__()
        self.pause = pause
        self.write = write or (lambda t: t.add_(offset))
        self.release = threading.Event()
        self.started = threading.Event()
        self.halfway = threading.Event()

    def average(self, tensors: Sequence[torch.Tensor], key: str, weight: float = 1.0,
                **kwargs: Any) -> list[torch.Tensor]:
        tensors = list(tensors)
        self.calls.append(Call([t.clone() for t in tensors], weight, {"key": key, **kwargs},
                               self.step_of()))
        self.started.set()
        assert self.release.wait(10)
        half = len(tensors) // 2
        for t in tensors[:half]:
            self.write(t)
        self.halfway.set()
        time.sleep(self.pause)
        for t in tensors[half:]:
            self.write(t)
        return tensors


def constant_grad_step(params: list[nn.Parameter], opt: moshpit.Optimizer,
                       grad: float) -> None:
    for p in params:
        p.grad = torch.full_like(p, grad)
    opt.step(batch_size=2)


def test_overlap_applies_the_delta_and_keeps_local_progress() -> None:
    params = [nn.Parameter(torch.full((5,), 1.0, dtype=torch.float64)),
              nn.Parameter(torch.full((2, 3), -2.0, dtype=torch.float64))]
    fake = GatedClient(offset=8.0)
    opt = make(torch.optim.SGD(params, lr=0.25), fake, average_every=2, overlap=True)
    constant_grad_step(params, opt, 1.0)
    constant_grad_step(params, opt, 1.0)  # step 2: snapshot (p0 = 0.5, p1 = -2.5), launched
    assert fake.started.wait(5)
    for _ in range(3):  # local progress while the round is in flight: -0.75
        constant_grad_step(params, opt, 1.0)
    assert opt.rounds_done == 0 and len(fake.calls) == 1
    assert torch.equal(fake.calls[0].tensors[0], torch.full((5,), 0.5, dtype=torch.float64))
    fake.release.set()
    opt.finish()
    # p = local (snapshot - 0.75) + (averaged - snapshot), averaged = snapshot + 8
    assert torch.equal(params[0].detach(), torch.full((5,), 0.5 - 0.75 + 8.0,
                                                      dtype=torch.float64))
    assert torch.equal(params[1].detach(), torch.full((2, 3), -2.5 - 0.75 + 8.0,
                                                      dtype=torch.float64))
    assert opt.rounds_done == 1 and fake.calls[0].weight == 4.0  # 2 steps x batch 2


def test_overlap_never_applies_a_half_written_result() -> None:
    params = [nn.Parameter(torch.zeros(64)) for _ in range(4)]
    fake = GatedClient(offset=1.0, pause=0.2)
    opt = make(torch.optim.SGD(params, lr=0.0), fake, average_every=1, overlap=True)
    constant_grad_step(params, opt, 0.0)
    assert fake.started.wait(5)
    fake.release.set()
    assert fake.halfway.wait(5)
    observed = set()
    steps_while_half_written = 0
    deadline = time.monotonic() + 5
    while opt.rounds_done == 0 and time.monotonic() < deadline:
        constant_grad_step(params, opt, 0.0)  # polls and applies on this thread
        values = {float(v) for p in params for v in p.detach().unique()}
        observed.add(frozenset(values))
        if opt.rounds_done == 0:
            steps_while_half_written += 1
    assert opt.rounds_done == 1
    assert steps_while_half_written > 0  # the optimizer did look while the buffer was half done
    assert observed <= {frozenset({0.0}), frozenset({1.0})}, observed  # all or nothing
    assert all(torch.equal(p.detach(), torch.ones(64)) for p in params)


def test_overlap_failure_keeps_local_values() -> None:
    params = [nn.Parameter(torch.zeros(3, dtype=torch.float64))]
    fake = FakeClient(errors=[AllreduceFailed("AllreduceError: peer died")])
    opt = make(torch.optim.SGD(params, lr=0.5), fake, average_every=1, overlap=True)
    constant_grad_step(params, opt, 1.0)
    opt.finish()
    assert opt.failed_rounds == 1 and opt.rounds_done == 0
    assert torch.equal(params[0].detach(), torch.full((3,), -0.5, dtype=torch.float64))
    for _ in range(2):
        constant_grad_step(params, opt, 1.0)
        opt.finish()
    assert opt.failed_rounds == 1 and opt.rounds_done == 2
    # -0.5 -0.5 (+100 from the round launched at step 2) -0.5 (+100 from step 3's round)
    assert torch.equal(params[0].detach(), torch.full((3,), 198.5, dtype=torch.float64))


def test_overlap_variance_state_stays_non_negative() -> None:
    # exp_avg_sq decays locally while the round is in flight; a much smaller average must not
    # push it below zero (sqrt of a negative is NaN in Adam's next step); exp_avg may go negative
    p = nn.Parameter(torch.zeros(4, dtype=torch.float64))
    fake = GatedClient(offset=0.0, write=lambda t: t.zero_())  # the "group" has all-zero state
    opt = make(torch.optim.Adam([p], lr=0.1), fake, average_every=1, overlap=True,
               average_state=True)
    constant_grad_step([p], opt, 10.0)  # exp_avg = 1, exp_avg_sq = 0.1; round launched
    assert fake.started.wait(5)
    for _ in range(3):
        constant_grad_step([p], opt, 0.0)  # local decay: exp_avg 0.729, exp_avg_sq 0.0997
    assert opt.rounds_done == 0
    fake.release.set()
    opt.finish()
    assert opt.rounds_done == 1
    state = opt.optimizer.state[p]
    assert torch.equal(state["exp_avg_sq"], torch.zeros(4, dtype=torch.float64))  # clamped
    torch.testing.assert_close(state["exp_avg"], torch.full((4,), 0.9**3 - 1,
                                                            dtype=torch.float64))
    assert float(state["step"]) == 4.0
    constant_grad_step([p], opt, 1.0)
    assert torch.isfinite(p).all()


def test_state_dict_round_trip_and_pass_through() -> None:
    model, fake = linear(), FakeClient()
    inner = torch.optim.Adam(model.parameters(), lr=0.01)
    opt = make(inner, fake, average_every=2, average_state=True)
    for _ in range(3):
        train_step(model, opt, 4)
    assert opt.param_groups is inner.param_groups
    saved = opt.state_dict()
    assert saved["moshpit"]["local_step"] == 3 and saved["moshpit"]["samples"] == 4
    model2, fake2 = linear(), FakeClient()
    opt2 = make(torch.optim.Adam(model2.parameters(), lr=0.01), fake2, average_every=2,
                average_state=True)
    opt2.load_state_dict(saved)
    assert (opt2.local_step, opt2.rounds_done, opt2.failed_rounds) == (3, 1, 0)
    train_step(model2, opt2, 4)  # step 4: the cadence goes on from the checkpoint
    assert len(fake2.calls) == 1 and fake2.calls[0].weight == 8.0
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_unreachable_socket_never_stops_training(tmp_path: Path) -> None:
    model = linear()
    opt = moshpit.Optimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                            client=str(tmp_path / "nobody.sock"), key="k", average_every=2)
    assert opt.failed_rounds == 0 and opt.client is None
    for _ in range(5):
        train_step(model, opt)
    assert opt.local_step == 5 and opt.rounds_done == 0 and opt.failed_rounds == 2
    assert isinstance(opt.last_error, DaemonUnavailable)
    assert "nobody.sock" in str(opt.last_error)
    opt.close()
