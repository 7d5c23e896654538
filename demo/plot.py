"""The demo's picture: every trainer's validation loss against the demo's wall time.

Drawn on matplotlib's Agg canvas directly, without pyplot: no display, no global backend, and
matplotlib is imported only here, once training is over.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Event:
    """A vertical line on the plot: a trainer killed, one joining."""

    seconds: float
    label: str


@dataclass(frozen=True)
class Mark:
    """A lone point: a joiner's loss with its own fresh weights, before its download."""

    seconds: float
    loss: float
    label: str


def plot_validation(path: Path, curves: Mapping[str, Sequence[tuple[float, float]]],
                    events: Sequence[Event], marks: Sequence[Mark], entropy: float,
                    target: float, title: str) -> Path:
    """One line per trainer of (seconds since the start, validation loss), with the byte
    unigram entropy (what a model that ignores context scores) and the target for scale.
    Averaged trainers hold one model, so their lines lie on top of each other."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name, points in curves.items():
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker=".", markersize=4, linewidth=1.2, label=name)
    for mark in marks:
        ax.plot([mark.seconds], [mark.loss], linestyle="none", marker="x", color="black",
                label=mark.label)
    ax.axhline(entropy, color="grey", linestyle=":",
               label=f"byte unigram entropy {entropy:.2f}")
    ax.axhline(target, color="black", linestyle="--", linewidth=0.8, label=f"target {target:g}")
    for event in events:
        ax.axvline(event.seconds, color="tab:red", linestyle="-.", linewidth=0.8)
        ax.annotate(event.label, (event.seconds, 0.6), xycoords=("data", "axes fraction"),
                    rotation=90, va="center", ha="right", fontsize=8, color="tab:red")
    ax.set_xlabel("seconds since the demo started")
    ax.set_ylabel("validation loss (nats per byte)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
