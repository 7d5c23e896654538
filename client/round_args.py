"""What the optimizer asks of every round it averages: Client.average's arguments, fixed when
the optimizer is built, and the keys derived from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moshpit.client import check_aggregation, check_local


@dataclass(frozen=True)
class RoundArgs:
    key: str
    grid: tuple[int, int] | None = None
    group_size: int = 16
    min_group_size: int = 2
    timeout: float = 30.0
    codec: str = "none"
    initial_coords: tuple[int, ...] | None = None
    aggregation: str = "mean"
    # one of local_world trainers of this host (torchrun's LOCAL_WORLD_SIZE): replicas, or
    # with local_rank (LOCAL_RANK) the shards of one vector
    local_world: int | None = None
    local_rank: int | None = None

    def __post_init__(self) -> None:
        check_aggregation(self.aggregation)
        check_local(self.local_world, self.local_rank)

    def average_kwargs(self) -> dict[str, Any]:
        """Client.average's keyword arguments (the local ones only for a local trainer, so a
        client that knows none still takes the rest)."""
        out: dict[str, Any] = dict(key=self.key, timeout=self.timeout,
                                   group_size=self.group_size,
                                   min_group_size=self.min_group_size, grid=self.grid,
                                   codec=self.codec, initial_coords=self.initial_coords,
                                   aggregation=self.aggregation)
        if self.local_world is not None:
            out.update(local_world=self.local_world, local_rank=self.local_rank)
        return out

    def sync_overrides(self, min_group_size: int | None, timeout: float | None
                       ) -> dict[str, Any]:
        """A blocking collective round under its own key, without the grid. A peer still in
        its last regular round (its partners already left for the sync) reaches the sync only
        when that round times out: wait long enough to include it."""
        return dict(key=f"{self.key}/sync", grid=None, initial_coords=None,
                    group_size=max(self.group_size, min_group_size or 0),
                    min_group_size=min_group_size or self.min_group_size,
                    timeout=timeout or 2 * self.timeout + 5.0)

    @property
    def state_key(self) -> str:
        """Where joiners find the state: per rank for shards (each holds its own slice)."""
        base = f"{self.key}/state"
        return base if self.local_rank is None else f"{base}/rank{self.local_rank}"
