"""bench.training's model and data: an MLP on sklearn's digits, small enough that its
processes share two cores comfortably."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from demo.data import SPLIT_SEED, Split, save_split, split_digits

INIT_SEED = 0  # same initial weights everywhere, so early averages do not cancel out

__all__ = ["INIT_SEED", "SPLIT_SEED", "Split", "accuracy", "load_shard", "make_model",
           "save_split", "split_digits"]


def make_model(hidden: int = 64, seed: int = INIT_SEED, batchnorm: bool = False) -> nn.Module:
    """A one-hidden-layer MLP; with batchnorm=True its running statistics are buffers, which
    moshpit.Optimizer(model=...) averages like the parameters."""
    torch.manual_seed(seed)
    norm: list[nn.Module] = [nn.BatchNorm1d(hidden)] if batchnorm else []
    return nn.Sequential(nn.Linear(64, hidden), *norm, nn.ReLU(), nn.Linear(hidden, 10))


def load_shard(shard: int, world: int, path: str | None = None) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One of `world` equal slices of the training split, plus the shared held-out split."""
    if path:
        with np.load(path) as saved:
            split = {k: saved[k] for k in saved.files}
    else:
        split = split_digits()
    per_rank = len(split["x_train"]) // world  # equal shards: every rank runs as many steps
    x = split["x_train"][shard::world][:per_rank]
    y = split["y_train"][shard::world][:per_rank]
    return (torch.from_numpy(x), torch.from_numpy(y).long(),
            torch.from_numpy(split["x_test"]), torch.from_numpy(split["y_test"]).long())


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Accuracy in eval mode (BatchNorm's running statistics); the mode is restored after."""
    was_training = model.training
    model.eval()
    try:
        return float((model(x).argmax(dim=1) == y).float().mean())
    finally:
        model.train(was_training)
