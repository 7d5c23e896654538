"""What a data-plane stream moved, frozen when it ends (a kept session carries the next)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stats:
    """A stream's bytes each way and when its first and last bytes moved."""

    bytes_in: int
    bytes_out: int
    first_in: float
    last_in: float
    first_out: float
    last_out: float

    def progress(self) -> int:
        return self.bytes_in + self.bytes_out
