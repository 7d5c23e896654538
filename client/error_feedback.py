"""Error feedback: what compression dropped of a trainer's contribution is added to its next
one, so over K rounds the sum of what was sent is within one round's error of the sum of the
true values (the error does not pile up).

The trainer quantizes its contribution itself with the daemon's own codec
(moshpitd.allreduce.codecs: numpy only, deterministic) and submits the quantized values. The
codecs are idempotent on values they produced, and the block codecs' parts start on block
boundaries of their run, so the daemon sends exactly these values to every owner: the residual
is exact, whichever span this trainer owns. The averaged result travels back compressed too;
error feedback does not cover that leg (every member receives the same result, so it is not a
bias of one trainer's contribution).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from moshpitd.allreduce.codecs import Codec, get_codec


def wire_values(tensors: Sequence[torch.Tensor], codec: Codec) -> list[torch.Tensor]:
    """What `codec` carries of CPU tensors submitted as one request: each run of consecutive
    tensors of one dtype is encoded whole, as the daemon's parts do (layout.runs_of)."""
    out: list[torch.Tensor] = []
    i = 0
    while i < len(tensors):
        j = i
        while j < len(tensors) and tensors[j].dtype == tensors[i].dtype:
            j += 1
        flat = torch.cat([t.detach().reshape(-1) for t in tensors[i:j]]).numpy()
        decoded = flat if codec.name == "none" else codec.decode(codec.encode(flat), flat.size,
                                                                 flat.dtype)
        values = torch.from_numpy(np.ascontiguousarray(decoded)).to(tensors[i].dtype)
        pos = 0
        for t in tensors[i:j]:
            out.append(values[pos:pos + t.numel()].reshape(t.shape))
            pos += t.numel()
        i = j
    return out


class ErrorFeedback:
    """The residual of each parameter (by index), kept on the CPU."""

    def __init__(self, codec: str) -> None:
        self.codec = get_codec(codec)
        self.residual: dict[int, torch.Tensor] = {}

    def compress(self, indices: Sequence[int], values: Sequence[torch.Tensor]
                 ) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
        """(values plus their residuals, as the wire will carry them; the residuals they leave).
        The new residuals count only once the round succeeded: see commit()."""
        with torch.no_grad():
            wanted = [v + self.residual[i] if i in self.residual else v.clone()
                      for i, v in zip(indices, values, strict=True)]
            sent = wire_values(wanted, self.codec)
            left = {i: w - s for i, w, s in zip(indices, wanted, sent, strict=True)}
        return sent, left

    def commit(self, residuals: dict[int, torch.Tensor]) -> None:
        self.residual.update(residuals)
