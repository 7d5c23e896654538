"""One sender's stream at the reducer side of a butterfly round (owner.py): its parts in,
our results back in the order they become final, and in a checked round the check's frames
(allreduce/ownercheck.py) after them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

import numpy as np

from moshpitd.allreduce.checks import CheckError
from moshpitd.allreduce.codecs import CodecError
from moshpitd.allreduce.layout import Part
from moshpitd.allreduce.ownercheck import OwnerCheck
from moshpitd.allreduce.plan import Ledger, RoundPlan
from moshpitd.allreduce.reducer import PartReducer, ReductionError
from moshpitd.allreduce.verifier import CLAIM, COMMIT, COMMITS, DISPUTE, END, REVEAL, SEEDS
from moshpitd.hooks import Hooks
from moshpitd.transport.dataplane import (
    ABORT,
    BAD_VALUES,
    CHECK,
    PART,
    RESULT,
    Channel,
    DataPlaneError,
    TamperedFrame,
)
from moshpitd.transport.stats import Stats


class ReducerSide(Protocol):
    """What a slot needs of the reducer side (owner.py)."""

    plan: RoundPlan
    ledger: Ledger
    hooks: Hooks
    reducer: PartReducer
    check: OwnerCheck | None
    release: Callable[[Channel], None] | None

    def contribute(self, part: Part, sender: int, values: np.ndarray | list[np.ndarray],
                   weight: float | None = None) -> None: ...

    def exclude(self, sender: int, why: str, fault: str = "other") -> None: ...

    def result_payload(self, index: int) -> memoryview: ...


class Outbox(asyncio.Queue[int]):
    """Parts whose results still go back to one sender. Once its stream is gone nothing is kept
    for it: the round waits until every outbox is empty, and this one would never empty."""

    closed = False

    def put_nowait(self, item: int) -> None:
        if not self.closed:
            super().put_nowait(item)

    def close(self) -> None:
        self.closed = True
        while not self.empty():
            self.get_nowait()


class SenderSlot:
    """Frames from one sender, and our results back to it."""

    def __init__(self, side: ReducerSide, sender: int, channel: Channel) -> None:
        self.side = side
        self.plan = side.plan
        self.sender = sender
        self.channel = channel
        listener = side.plan.group.listeners >> sender & 1
        self.expected = set() if listener else {p.index for p in side.plan.my_parts}
        self.staging = side.ledger.staging()
        self.outbox = Outbox()
        self.released: Stats | None = None  # the stream ended cleanly: its connection is
        # the registry's again (a kept session), and these were its bytes, which end at
        self.released_end = 0  # this offset of the connection (`Channel.written`)
        self.ended = False  # a checked round's END went out (or the stream is gone)

    def buffer_for(self, kind: int, part: int, length: int, aux: int) -> memoryview | None:
        if kind != PART:
            return None
        p = self.plan.part(part)
        if p is None or part not in self.expected:
            raise DataPlaneError(f"member {self.sender} sent part {part}, not expected here")
        want = self.plan.encoded_size(p)
        if length != want:
            raise DataPlaneError(f"part {part}: {length} bytes, expected {want}")
        if self.side.check is not None and not self.side.ledger.closed:
            return self.side.ledger.retain(want)  # kept: claims are checked against it
        return self.staging  # it has room for the next header past the payload

    def on_frame(self, kind: int, part: int, payload: memoryview, aux: int) -> None:
        if kind == PART:
            self.expected.discard(part)
            p = self.plan.parts[part]
            try:
                values = self.plan.codec.decode(payload, p.numel, self.plan.dtypes[p.run])
                if self.side.check is not None:  # before `contribute` reads it (in place)
                    self.side.check.keep(self.sender, part, payload)
                self.side.contribute(p, self.sender, values)
            except (ReductionError, CodecError) as exc:
                self.channel.abort(exc, part, BAD_VALUES)  # first: exclude's abort says less
                self.side.exclude(self.sender, str(exc), "bad_data")
        elif kind == CHECK and self.side.check is not None:
            try:
                self._on_check(aux, payload)
            except CheckError as exc:
                self.side.exclude(self.sender, f"its check messages are wrong: {exc}",
                                  "protocol")
                self.channel.abort(f"check: {exc}")
        elif kind == ABORT:
            self.side.exclude(self.sender,
                              f"it aborted: {bytes(payload).decode(errors='replace')}",
                              "aborted")
        else:
            self.side.exclude(self.sender, f"unexpected frame kind {kind}", "protocol")
            self.channel.abort(f"unexpected frame kind {kind}")

    def _on_check(self, step: int, payload: memoryview) -> None:
        check = self.side.check
        assert check is not None
        if step == COMMIT:
            check.on_commit(self.sender, payload)
        elif step == REVEAL:
            check.on_reveal(self.sender, payload)
        elif step == CLAIM:
            check.on_claim(self.sender, payload)
        else:
            raise CheckError(f"check step {step} is not one a sender sends")

    def on_close(self, exc: BaseException | None) -> None:
        self.ended = True
        self.outbox.close()
        if isinstance(exc, TamperedFrame):  # its later parts would be no more trustworthy
            self.side.exclude(self.sender, f"its stream was tampered with: {exc}", "tampered")
        elif self.expected:
            self.side.exclude(self.sender, f"its stream closed ({exc or 'EOF'})",
                              "disconnected")

    def progress(self) -> int:
        return self.stats().progress()

    def stats(self) -> Stats:
        """This round's bytes on the sender's stream (its connection may carry the next)."""
        return self.released if self.released is not None else self.channel.stats()

    def drained(self) -> bool:
        if self.released is not None:  # the connection may carry another round's stream
            return self.channel.flushed(self.released_end) or not self.channel.is_open()
        transport = self.channel.transport
        if self.side.check is not None and not self.ended:
            return False
        return self.outbox.empty() and (transport is None or transport.is_closing()
                                        or transport.get_write_buffer_size() == 0)

    def results_out(self) -> bool:
        """Every result went to the transport and left it (so the sender has them, or will
        soon): from then on we wait for its word for a while only."""
        transport = self.channel.transport
        return self.outbox.empty() and (transport is None or transport.is_closing()
                                        or transport.get_write_buffer_size() == 0)

    async def write_results(self) -> None:
        """Results go back in the order parts become final (in a checked round after our
        list of commitments, and followed by the check's frames)."""
        check = self.side.check
        sent = 0
        while True:
            index = await self.outbox.get()
            mask = self.side.ledger.mask(index)
            payload = self.side.result_payload(index) if mask else b""
            p = self.plan.parts[index]
            payload = await self.side.hooks.before_result(sent, payload, self.plan.codec,
                                                          p.numel, self.plan.dtypes[p.run])
            sent += 1
            last = sent == len(self.plan.my_parts) and not self.expected
            try:
                if check is not None and sent == 1:
                    listed = check.fix_commitments(self.side.reducer.excluded)
                    await self.channel.send(CHECK, index, listed, aux=COMMITS)
                await self.channel.send(RESULT, index, payload, aux=mask,
                                        then=self._release if last and check is None else None)
                if last and check is not None:
                    await self._checked(check)
            except DataPlaneError:
                self.outbox.close()
                self.ended = True
                return  # the sender is gone; its link will report that on its side
            if last:
                return

    async def _checked(self, check: OwnerCheck) -> None:
        """After our last result: the seeds, then every other contributor's claim, then END
        (which hands a kept session on, as the last result does in an unchecked round)."""
        await check.seeds_out.wait()
        await self.channel.send(CHECK, 0, check.seeds_payload(), aux=SEEDS)
        await check.claims_out.wait()
        for claimant, claim in check.claims.items():
            if claimant != self.sender:
                await self.channel.send(CHECK, 0, claim, aux=CLAIM)
        for claimant in sorted(check.disputed):
            await self.channel.send(CHECK, 0, claimant.to_bytes(2, "big"), aux=DISPUTE)
        await self.channel.send(CHECK, 0, b"", aux=END, then=self._release)
        self.ended = True

    def _release(self) -> None:
        """Every part came in and this is the last result: the connection may carry the
        sender's next stream. Handed on as the result is queued, before the sender can answer
        it (its next frame may be a new stream's ATTACH). The result may still wait in our
        send buffer, as views of the trainer's buffer: the round waits for it to drain as
        before (`drained`), and drops it if the round ends first (`abort_undrained`)."""
        side = self.side
        if side.release is None or side.ledger.closed or not self.channel.is_open() \
                or side.reducer.excluded >> self.sender & 1 \
                or (side.check is not None and self.sender in side.check.disputed):
            return  # (a claimant caught lying is named: no session is kept with it)
        self.released = self.channel.stats()
        self.released_end = self.channel.written
        side.release(self.channel)

    def abort_undrained(self) -> None:
        """The round is over: a handed-on connection still holding this round's result (a
        view of the trainer's buffer) is closed, its bytes dropped, as the round's own are."""
        if self.released is not None and not self.drained():  # (once the sender has our
            self.channel.close()  # last result, anything unsent is another stream's)
