"""What lets moshpit.Optimizer stand where a torch optimizer is expected: LR schedulers, AMP's
GradScaler and training loops read and write the wrapped optimizer through these."""

from __future__ import annotations

from typing import Any, Self

import torch


class WrappedOptimizer:
    optimizer: torch.optim.Optimizer

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def close(self) -> None:
        """Subclasses finish their rounds and let go of their daemon."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
