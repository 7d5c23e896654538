"""Where a test may act inside the daemon: points in a round, in a state download and where a
leader sends its group.

Production runs the no-op `Hooks`; the fault tests install `moshpitd.faults.FaultPlan` through
the daemon's entry point when MOSHPITD_FAULT is set (moshpitd/service.py). Nothing on the hot
path imports the fault module, and each hook is one call that returns at once by default.
"""

from __future__ import annotations

import numpy as np

from moshpitd.allreduce.codecs import Codec
from moshpitd.allreduce.group import Group


class Hooks:
    """The points themselves; every method does nothing here."""

    def begin_round(self, link_parts: list[int], senders: int, listening: bool = False) -> None:
        """A round starts: `link_parts` parts go to each other owner, `senders` members
        stream parts to us; `listening`: we have weight 0 (we only take the results)."""

    def sender_accepted(self) -> None:
        """A member's stream reached us as a reducer."""

    async def before_part(self, sent: int) -> None:
        """A sender is about to stream a part to an owner; `sent` went out on that link."""

    def contribution(self) -> None:
        """A contribution from another member is being reduced."""

    async def before_result(self, sent: int, payload: memoryview | bytes, codec: Codec,
                            numel: int, dtype: np.dtype) -> memoryview | bytes:
        """A reducer is about to return a result (`sent` went out on that stream already);
        returns the payload to send."""
        return payload

    async def serving_state(self, chunks_sent: int) -> None:
        """A donor streams a range of its state, `chunks_sent` chunks in."""

    def relayed(self, data: bytes) -> bytes:
        """A relay passes data-plane bytes between two peers; returns what it passes on."""
        return data

    def leading(self, group: Group) -> Group:
        """A leader assembled `group`; returns the group it sends its followers."""
        return group


NO_HOOKS = Hooks()
