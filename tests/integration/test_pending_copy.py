"""A trainer's tensors go into the shared buffer while its daemon looks for a group (`average`
with `pending`, then `ready`: IPC protocol 4), so copies from a GPU overlap matchmaking. The
daemon must read the buffer only after `ready`, and send nothing of it when the copy failed
(`abandon`) or `ready` never came. Real daemons, real clients; the copy is the client's own
(DeviceCopier.to_buffer), wrapped to control when it runs and whether it fails."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import moshpit
from moshpit.connection import DaemonConnection
from moshpit.device_copy import DeviceCopier
from moshpitd.ipc import schema as wire
from moshpitd.launcher import LocalSwarm
from tests.integration.helpers import active_keys, run_parallel, wait_until
from tests.integration.test_ipc_robustness import check_daemons_still_average

N = 50_000
SENTINEL = 1e6  # what a half-filled buffer holds: no result may ever contain it


def test_tensors_copied_in_after_the_request_are_the_ones_averaged(
        swarm_factory: Callable[..., LocalSwarm], monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainer 0's copy waits until both daemons are matchmaking under the key: what the
    daemons average must be the tensors copied in then, not the buffer as it was asked."""
    swarm = swarm_factory(2)
    clients = [moshpit.Client(s) for s in swarm.sockets[:2]]
    observers = [moshpit.Client(s) for s in swarm.sockets[:2]]  # a client's own is busy
    copy = DeviceCopier.to_buffer
    seen: list[bool] = []

    def late_copy(self: DeviceCopier, buf: Any, views: Sequence[torch.Tensor],
                  tensors: Sequence[torch.Tensor]) -> None:
        if self is clients[0]._device:
            seen.append(wait_until(lambda: all("late" in active_keys(o) for o in observers),
                                   20, "both daemons matchmaking under 'late'"))
        copy(self, buf, views, tensors)

    monkeypatch.setattr(DeviceCopier, "to_buffer", late_copy)
    xs = [torch.randn(N, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    out = run_parallel([lambda i=i: clients[i].average([xs[i]], key="late", timeout=20)
                        for i in range(2)])
    assert seen, "trainer 0 never copied"
    exact = (xs[0] + xs[1]) / 2
    for r in out:
        assert not isinstance(r, Exception), r
        assert torch.allclose(r[0], exact, atol=1e-6)


def half_filled_then_failing(clients: list[moshpit.Client]) -> Callable[..., None]:
    copy = DeviceCopier.to_buffer

    def broken(self: DeviceCopier, buf: Any, views: Sequence[torch.Tensor],
               tensors: Sequence[torch.Tensor]) -> None:
        if self is clients[0]._device:
            views[0][: N // 2].fill_(SENTINEL)
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        copy(self, buf, views, tensors)
    return broken


def test_a_failed_copy_abandons_the_request_and_nothing_of_it_is_sent(
        swarm_factory: Callable[..., LocalSwarm], monkeypatch: pytest.MonkeyPatch) -> None:
    swarm = swarm_factory(2)
    clients = [moshpit.Client(s) for s in swarm.sockets[:2]]
    monkeypatch.setattr(DeviceCopier, "to_buffer", half_filled_then_failing(clients))
    xs = [torch.zeros(N), torch.ones(N)]
    out = run_parallel([lambda i=i: clients[i].average([xs[i]], key="broken", timeout=8)
                        for i in range(2)])
    assert isinstance(out[0], RuntimeError) and "illegal memory access" in str(out[0]), out[0]
    # the partner got its own values, or an error: never the half-filled buffer
    if not isinstance(out[1], Exception):
        assert out[1][0].max().item() < SENTINEL / 2, out[1][0].max()
    # the key is free again on trainer 0's daemon once the abandoned request has ended
    wait_until(lambda: "broken" not in active_keys(clients[0]), 20, "the request to end")
    monkeypatch.undo()
    again = run_parallel([lambda i=i: clients[i].average([xs[i]], key="broken", timeout=20)
                          for i in range(2)])
    for r in again:
        assert not isinstance(r, Exception), r
        assert torch.allclose(r[0], torch.full((N,), 0.5))
    check_daemons_still_average(swarm)


def test_a_trainer_that_never_says_ready_gets_the_round_s_failure_and_sends_nothing(
        swarm_factory: Callable[..., LocalSwarm], monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy that never completes (a hung device): the daemon waits for `ready` no longer
    than the request's timeout, then fails it; the partner never sees the buffer's bytes."""
    swarm = swarm_factory(2)
    clients = [moshpit.Client(s) for s in swarm.sockets[:2]]
    send = DaemonConnection.send

    def hung(self: DaemonConnection, req: wire.Message, timeout: float,
             fd: int | None = None, awaited: bool = True) -> int:
        if self is clients[0]._conn and isinstance(req, wire.ReadyRequest):
            return 0  # never sent
        return send(self, req, timeout, fd, awaited)

    monkeypatch.setattr(DaemonConnection, "send", hung)
    copy = DeviceCopier.to_buffer

    def filled(self: DeviceCopier, buf: Any, views: Sequence[torch.Tensor],
               tensors: Sequence[torch.Tensor]) -> None:
        copy(self, buf, views, tensors)
        if self is clients[0]._device:
            views[0].fill_(SENTINEL)  # what the buffer holds; the daemon was never told
    monkeypatch.setattr(DeviceCopier, "to_buffer", filled)
    xs = [torch.zeros(N), torch.ones(N)]
    out = run_parallel([lambda i=i: clients[i].average([xs[i]], key="hung", timeout=4)
                        for i in range(2)])
    assert isinstance(out[0], moshpit.AllreduceFailed), out[0]
    assert "'ready'" in str(out[0]) and "nothing of it was sent" in str(out[0]), out[0]
    if not isinstance(out[1], Exception):
        assert out[1][0].max().item() < SENTINEL / 2, out[1][0].max()
    monkeypatch.undo()
    check_daemons_still_average(swarm)


def test_ready_for_no_pending_request_is_refused_naming_the_field(
        swarm_factory: Callable[..., LocalSwarm]) -> None:
    swarm = swarm_factory(1)
    conn = DaemonConnection(swarm.sockets[0], 5.0)
    conn.hello(5.0)
    with pytest.raises(moshpit.InvalidRequest, match="names no pending average"):
        conn.request(wire.ReadyRequest(request=12345), 5.0)
    with pytest.raises(moshpit.InvalidRequest, match="pending"):
        conn.request(wire.AverageRequest(key="k", tensors=[], pending=True, local_world=2),
                     5.0)
    conn.close()
