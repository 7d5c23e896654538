"""The demo's model and data: small enough that four trainers share two cores comfortably."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

SPLIT_SEED = 0  # every trainer must hold out the same test set
INIT_SEED = 0  # same initial weights everywhere, so early averages do not cancel out

Split = dict[str, np.ndarray]


def make_model(hidden: int = 64) -> nn.Module:
    torch.manual_seed(INIT_SEED)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def split_digits() -> Split:
    """sklearn's 8x8 digits (shipped with the package, nothing downloaded), 20% held out."""
    # Imported here: trainers read the split demo.run saved and skip sklearn's import time.
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)  # pixels are 0..16
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, random_state=SPLIT_SEED, stratify=y)
    return {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}


def save_split(path: Path) -> None:
    s = split_digits()
    np.savez(path, x_train=s["x_train"], y_train=s["y_train"], x_test=s["x_test"],
             y_test=s["y_test"])


def load_shard(rank: int, world: int, path: str | None = None) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's slice of the training split, plus the shared held-out split."""
    if path:
        with np.load(path) as saved:
            split = {k: saved[k] for k in saved.files}
    else:
        split = split_digits()
    per_rank = len(split["x_train"]) // world  # equal shards: every rank runs as many steps
    x = split["x_train"][rank::world][:per_rank]
    y = split["y_train"][rank::world][:per_rank]
    return (torch.from_numpy(x), torch.from_numpy(y).long(),
            torch.from_numpy(split["x_test"]), torch.from_numpy(split["y_test"]).long())


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((model(x).argmax(dim=1) == y).float().mean())
