"""bench.training's data, without torch: it saves the split once, its workers read it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

SPLIT_SEED = 0  # every trainer must hold out the same test set

Split = dict[str, np.ndarray]


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
