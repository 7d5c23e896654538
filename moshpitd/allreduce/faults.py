"""Fault injection for the fault tests: a daemon told to misbehave in one round.

Set MOSHPITD_FAULT=KIND[@ROUND] (ROUND counts this daemon's all-reduce rounds from 1; default 1)
and optionally MOSHPITD_FAULT_MARKER=PATH, a file written the moment the fault fires, so a test
can act (kill a process) at a known point. Unset in production: every hook is then a no-op.

KIND: crash-before-send, crash-mid-send, stall-send, slow-send (pauses SLOW_SECONDS, then goes
on), crash-while-reducing, stall-reduce.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass

KINDS = {"crash-before-send", "crash-mid-send", "stall-send", "slow-send",
         "crash-while-reducing", "stall-reduce"}
STALL_SECONDS = 3600.0
SLOW_SECONDS = 1.5


@dataclass
class FaultPlan:
    kind: str = ""
    at_round: int = 1
    marker: str | None = None
    rounds: int = 0

    @classmethod
    def from_env(cls) -> FaultPlan:
        spec = os.environ.get("MOSHPITD_FAULT", "")
        if not spec:
            return cls()
        kind, _, at = spec.partition("@")
        if kind not in KINDS:
            raise ValueError(f"MOSHPITD_FAULT={spec!r}: unknown fault (one of {sorted(KINDS)})")
        return cls(kind, int(at or 1), os.environ.get("MOSHPITD_FAULT_MARKER"))

    def begin_round(self) -> None:
        self.rounds += 1

    def _now(self, kind: str) -> bool:
        return self.kind == kind and self.rounds == self.at_round

    def _fire(self) -> None:
        if self.marker:
            with open(self.marker, "w") as f:
                f.write(self.kind)

    def _crash(self) -> None:
        self._fire()
        os._exit(17)

    def before_send(self) -> None:
        if self._now("crash-before-send"):
            self._crash()

    async def during_send(self, sent: int) -> None:
        """Called before each part a sender streams; `sent` parts went out already."""
        if sent == 1 and self._now("crash-mid-send"):
            self._crash()
        if sent == 1 and self._now("stall-send"):
            self._fire()
            await asyncio.sleep(STALL_SECONDS)
        if sent == 1 and self._now("slow-send"):
            self._fire()
            await asyncio.sleep(SLOW_SECONDS)

    def while_reducing(self) -> None:
        if self._now("crash-while-reducing"):
            self._crash()

    def stall_reduce(self) -> bool:
        if self._now("stall-reduce"):
            self._fire()
            return True
        return False
