"""Shards: a host's vector is its local ranks' tensors concatenated in rank order, each rank's
lying in its own trainer's shared buffer. The all-reduce reads and writes them where they lie.

A FlatView already cuts a part that crosses a gap between two tensors into pieces; a ShardView
is a FlatView whose segments come from several buffers, so a part across two ranks is two
pieces, and nothing is copied to assemble the vector or to hand each rank its slice back.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from moshpitd.allreduce.layout import FlatView, LayoutError, runs_of, schema_of
from moshpitd.matchmaking.declaration import rank_digests

Span = tuple[int, int, int]


class ShardView(FlatView):
    """The concatenation of one FlatView per local rank, in rank order. Each rank's view
    checked its specs against its own buffer; this one only stitches their segments."""

    def __init__(self, shards: Sequence[FlatView]) -> None:  # no super().__init__: one buffer
        self.shards = list(shards)
        self.specs = [s for v in self.shards for s in v.specs]
        self.runs = runs_of(self.specs)
        self._arrays = [a for v in self.shards for a in v._arrays]
        self._base = 0
        self._views = {}
        counts = [len(v.specs) for v in self.shards]
        self.first_tensor = [0, *itertools.accumulate(counts)]
        numels = [sum(s.numel for s in v.specs) for v in self.shards]
        self.first_element = [0, *itertools.accumulate(numels)]
        run_of: dict[int, int] = {}
        offset_in_run: dict[int, int] = {}  # a tensor's first element within its run
        for r, run in enumerate(self.runs):
            pos = 0
            for i in run.tensors:
                run_of[i], offset_in_run[i] = r, pos
                pos += self.specs[i].numel
        self._segments = [[] for _ in self.runs]
        for rank, view in enumerate(self.shards):
            for local_run, segments in zip(view.runs, view._segments, strict=True):
                first = self.first_tensor[rank] + local_run.tensors[0]
                shift = offset_in_run[first]
                self._segments[run_of[first]].extend((start + shift, arr)
                                                     for start, arr in segments)
        self._starts = [[start for start, _ in segments] + [run.numel]
                        for segments, run in zip(self._segments, self.runs, strict=True)]
        # (first address, last address + 1, rank) of every segment, to tell whose a piece is
        self._ranges = [(arr.ctypes.data, arr.ctypes.data + arr.nbytes, rank)
                        for rank, view in enumerate(self.shards)
                        for segments in view._segments for _, arr in segments]

    def rank_digests(self) -> bytes:
        """What the host declares so that a mismatch with a peer names the rank."""
        return rank_digests([schema_of(v.specs) for v in self.shards])

    def check_finite(self, fp16: bool = False) -> None:
        for rank, view in enumerate(self.shards):
            try:
                view.check_finite(fp16)
            except LayoutError as exc:
                raise LayoutError(f"local rank {rank}: {exc}") from None

    def check_piece(self, piece: np.ndarray, fp16: bool = False) -> None:
        """Names the rank and its tensor at fault."""
        rank = self.rank_of(piece)
        try:
            self.shards[rank].check_piece(piece, fp16)
        except LayoutError as exc:
            raise LayoutError(f"local rank {rank}: {exc}") from None

    def rank_of(self, piece: np.ndarray) -> int:
        """Whose tensors a piece (a slice of one segment) lies in."""
        start, stop = piece.ctypes.data, piece.ctypes.data + piece.nbytes
        for lo, hi, rank in self._ranges:
            if lo <= start and stop <= hi:
                return rank
        raise ValueError("the piece lies in none of the local ranks' tensors")

    def rank_spans(self, spans: Sequence[Span], rank: int) -> tuple[Span, ...]:
        """The round's spans (over the host's vector) as seen by one rank: clipped to its
        slice, counted from its first element."""
        lo, hi = self.first_element[rank], self.first_element[rank + 1]
        return tuple((max(a, lo) - lo, min(b, hi) - lo, mask) for a, b, mask in spans
                     if max(a, lo) < min(b, hi))

