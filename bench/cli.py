"""Command-line pieces every benchmark shares."""

from __future__ import annotations

import argparse
import signal
from typing import NoReturn


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _on_sigterm(signum: int, frame: object) -> NoReturn:
    raise SystemExit(128 + signum)  # unwinds through the cleanup of every child and daemon


def exit_on_sigterm() -> None:
    """SIGTERM behaves like Ctrl-C: finally blocks stop every child and daemon."""
    signal.signal(signal.SIGTERM, _on_sigterm)


def print_columns(cells: list[list[str]]) -> None:
    """A table: first row the titles, first column left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    for i, row in enumerate(cells):
        print("  ".join(c.ljust(w) if j == 0 else c.rjust(w)
                        for j, (c, w) in enumerate(zip(row, widths, strict=True))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
