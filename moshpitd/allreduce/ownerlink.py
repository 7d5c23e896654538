"""One owner's side of our stream, as the sender sees it: its READY, and the averaged parts
coming back from it.

An owner's results are untrusted like any contribution: each is received into the link's staging
buffer, checked for NaN/Inf, and only then copied into the trainer's buffer; a non-finite one
leaves the part at our local values (mask 0). Receiving straight into the trainer's buffer would
save that copy, but a poisoned result would then have overwritten the very values we must fall
back to, and their only other copy went to that owner. (Setting our values aside as a result's
header arrives, and receiving in place, was measured and is no cheaper: the kernel writes
received bytes past the cache either way, so one part-sized read from memory stays.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Protocol

from moshpitd import timebase
from moshpitd.allreduce.checks import CheckError, Unverifiable, Verdict
from moshpitd.allreduce.layout import Part, all_finite
from moshpitd.allreduce.plan import Ledger, RoundPlan
from moshpitd.allreduce.verifier import (
    CLAIM,
    COMMITS,
    DISPUTE,
    END,
    REVEAL,
    SEEDS,
    SpanVerifier,
)
from moshpitd.identity import PeerKey
from moshpitd.transport.dataplane import (
    ABORT,
    BAD_VALUES,
    BUSY,
    CHECK,
    LEFT,
    READY,
    RESULT,
    Channel,
    DataPlaneError,
    TamperedFrame,
)
from moshpitd.transport.handshake import Handshake, HandshakeError, Pending
from moshpitd.transport.session import stream_context
from moshpitd.transport.stats import Stats

log = logging.getLogger("moshpitd.allreduce.butterfly")


class Exclusions(Protocol):
    """What the sender side tells the reducer side: an owner is also a sender to us, and when
    its daemon is gone its parts will not come either."""

    def exclude(self, sender: int, why: str, fault: str = "other") -> None: ...

    def lost(self, sender: int, why: str, fault: str) -> None:
        """Exclude `sender` if we still lack any of its parts."""


class ReadyGate:
    """Every owner READY (or failed): one event per round, whatever the group's size.

    A member streams its parts once every owner has the round (it answers our HELLO with
    READY), or the clock's start wait after the round started. Members learn of their group up
    to ~20-30 ms apart on a busy machine: those that stream meanwhile take the CPU the late one
    needs to learn of it, and then it is left alone with its share of the work at the end of
    the round, one core idle."""

    def __init__(self, owners: int, until: float) -> None:
        self.left = owners
        self.until = until
        self.event = asyncio.Event()
        self.opened = timebase.monotonic()  # when the last owner answered (the phase log's)
        if owners <= 0:
            self.event.set()

    def mark(self) -> None:
        self.left -= 1
        if self.left <= 0 and not self.event.is_set():
            self.opened = timebase.monotonic()
            self.event.set()

    async def wait(self, deadline: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(min(self.until, deadline) - timebase.monotonic(), 0)):
                await self.event.wait()


class OwnerLink:
    """Averaged parts coming back from one owner."""

    def __init__(self, plan: RoundPlan, ledger: Ledger, owner: int, parts: list[Part],
                 gate: ReadyGate, exclusions: Exclusions, key: PeerKey | None = None) -> None:
        self.plan = plan
        # a checked round holds the owner's results until they pass (allreduce/verifier.py)
        self.check = SpanVerifier(plan, owner, parts, key) \
            if plan.checking and key is not None else None
        self.ledger = ledger
        self.owner = owner
        self.parts = parts
        self.waiting = {p.index for p in parts}
        self.done = asyncio.Event()
        self.progress = asyncio.Event()  # set per result: the send window moves
        self.failure: str | None = None
        self.told = False  # it sent ABORT: its stream then closes, and that is no news
        self.staging = ledger.staging()  # results land here to be checked
        self._gate = gate
        self._exclusions = exclusions
        self._ready = False  # READY came (or the owner failed)
        self.channel: Channel | None = None  # the stream of the current attempt
        self.pending: Pending | None = None  # our HELLO, until the owner's READY answers it
        self.handshake: Handshake | None = None
        self.answered = asyncio.Event()  # READY proved the owner, or BUSY, or it failed
        self.busy = False
        self.unready = False  # our HELLO or ATTACH went out, the owner's READY did not come
        self.resumed = False  # the attempt runs on a kept session (ATTACH, not HELLO)
        self.stale = False  # ... and that session was gone before its READY
        self.context = stream_context(plan.group.digest, plan.me, owner)
        self.whole = True  # every result so far counts our part (so the owner kept it all)
        self.final: Stats | None = None  # the stream's bytes, once its connection was kept
        self.sent_at = 0.0  # when our last part went to the transport (the phase log's)

    def opening(self, channel: Channel, handshake: Handshake, pending: Pending | None) -> None:
        """A new attempt at the stream: `pending` is the HELLO we sent on `channel`, or None
        for the ATTACH on a kept session."""
        self.channel, self.handshake, self.pending = channel, handshake, pending
        self.busy = self.stale = False
        self.unready, self.resumed = True, pending is None
        self.answered.clear()

    def reusable(self) -> bool:
        """The stream ended cleanly both ways: every part in at the owner, every result here,
        nothing said against it. Its connection can carry our next stream to this peer."""
        ch = self.channel
        return (ch is not None and ch.is_open() and ch.session is not None and self.whole
                and not self.waiting and self.failure is None and not self.told
                and not self.unready
                and (self.check is None or (self.check.verdict is not None
                                            and self.check.verdict.ok)))

    def buffer_for(self, kind: int, part: int, length: int, aux: int) -> memoryview | None:
        if self.unready and kind not in (READY, ABORT):
            raise DataPlaneError(f"owner {self.owner} sent frame kind {kind} before its READY")
        if kind != RESULT:
            return None
        p = self.plan.part(part)
        if p is None or p.owner != self.owner or part not in self.waiting:
            raise DataPlaneError(f"owner {self.owner} returned part {part}, not expected")
        want = self.plan.encoded_size(p) if aux else 0
        if length != want:
            raise DataPlaneError(f"result {part}: {length} bytes, expected {want}")
        if self.check is not None and want and not self.ledger.closed:
            return self.ledger.retain(want)  # held there until the span passes
        return self.staging  # consumed by on_frame before the next frame

    def on_frame(self, kind: int, part: int, payload: memoryview, aux: int) -> None:
        if kind == READY:
            self._proven(payload)
            return
        if kind == ABORT and aux == BUSY and self.unready:
            self.busy = True  # no room for us there yet: the stream opens again
            self.answered.set()
            return
        if kind == ABORT:
            why = bytes(payload).decode(errors="replace")
            self.told = True
            if aux == BAD_VALUES:  # were our values to blame? then our trainer hears of it
                self._recheck(part)
            self.fail(why)
            if aux == LEFT:  # nor will its parts come, if any are still missing
                self._exclusions.lost(self.owner, f"it left the round: {why}", "aborted")
            return
        if kind == CHECK and self.check is not None:
            self._checking(self._on_check, aux, payload)
            return
        if kind != RESULT:
            self.fail(f"unexpected frame kind {kind}")
            return
        if self.ledger.closed:  # the round is over: the trainer's buffer is its own again,
            return  # and this part stays reported as what it held at the close
        p = self.plan.parts[part]
        if aux and (aux >> self.plan.size):
            self.fail(f"result {part} names members that do not exist")
            return
        if not (self.plan.listening or aux >> self.plan.me & 1):
            self.whole = False  # the owner lacks our part: it will not keep the stream
            if aux and self.check is not None:  # an honest owner that dropped us aborted our
                # stream: a mask without us on it would let it choose whose claims count
                self._judged(Verdict(False, f"result {part} leaves out our part", lied=True))
                return
        values = None
        if aux:
            values = self.plan.codec.decode(payload, p.numel, self.plan.dtypes[p.run])
            if not all_finite(values):
                log.warning("owner %d returned NaN or Inf for part %d: it keeps local values",
                            self.owner, part)
                values, aux = None, 0
        if self.check is not None:
            if not self._checking(self.check.hold, p, values, aux):
                return
        else:
            if values is not None:
                self.plan.view.write(p, values)
            self.ledger.apply(part, aux)
        self.waiting.discard(part)
        if not self.waiting:
            if self.check is not None:  # the owner can no longer change what it sent us
                seed = self.check.reveal()
                if seed is not None and self.channel is not None:
                    self.channel.send_nowait(CHECK, self.owner, seed, aux=REVEAL)
            else:
                self._ended()
        self.progress.set()

    def _ended(self) -> None:
        """The stream's last frame from the owner came."""
        if self.reusable():  # the owner handed the session on as it sent it: what
            assert self.channel is not None and self.channel.session is not None
            self.channel.cipher = self.channel.session.control  # comes next is sealed so
        self.done.set()

    def _checking(self, step: Callable[..., object], *args: object) -> bool:
        """Runs one step of the check; a step the owner's frames broke ends it: as a lie where
        an honest owner never sends that, else unchecked (nobody to blame)."""
        try:
            step(*args)
        except Unverifiable as exc:
            self._judged(Verdict(False, str(exc)))
            return False
        except CheckError as exc:  # the owner's own frames, or what it vouched for
            self._judged(Verdict(False, f"its check messages are wrong: {exc}", lied=True))
            return False
        return True

    def _on_check(self, step: int, payload: memoryview) -> None:
        check = self.check
        assert check is not None
        if step == COMMITS:
            check.on_commits(payload)
        elif step == SEEDS:
            if self.waiting:
                raise CheckError("seeds before every result")
            claim = check.on_seeds(payload)
            if claim is not None and self.channel is not None:
                self.channel.send_nowait(CHECK, self.owner, claim, aux=CLAIM)
        elif step == CLAIM:
            check.on_claim(payload)
        elif step == DISPUTE:
            check.on_dispute(payload)
        elif step == END:
            self._judged(check.decide())
        else:
            raise CheckError(f"check step {step} is not one an owner sends")

    def _judged(self, verdict: Verdict) -> None:
        """The span passed (its results go to the trainer's buffer), or it did not (none do:
        the trainer keeps its own values for the whole span)."""
        check = self.check
        assert check is not None
        if check.verdict is None or check.verdict.ok:
            check.verdict = verdict
        if self.done.is_set():
            return
        if verdict.ok:
            check.apply(self.ledger)
            self._ended()
            return
        if verdict.passed:
            check.apply(self.ledger)  # the parts that could be checked, and passed
        if verdict.lied:
            log.warning("owner %d (peer %s) of group %s failed the check of its span: %s; "
                        "the span keeps local values", self.owner,
                        self.plan.group.members[self.owner].peer_id.hex()[:16],
                        self.plan.group.group_id.hex()[:8], verdict.why)
        else:
            log.info("owner %d's span could not be checked whole: %s; what was not checked "
                     "keeps local values", self.owner, verdict.why)
        self.failure = self.failure or verdict.why
        self.done.set()
        self.progress.set()

    def _proven(self, ready: memoryview) -> None:
        """The owner's READY: it must prove the owner's key and answer our HELLO; the stream
        is sealed from the next frame on when the daemons encrypt."""
        if not self.unready or self.handshake is None or self.channel is None:
            self.fail("READY that answers no HELLO of ours")
            return
        if self.resumed:  # opened with the session's control keys: the session vouches
            session = self.channel.session
            assert session is not None
            if len(ready):
                self.fail("a kept session's READY carries nothing")
                self.channel.abort("malformed READY")
                return
            self.channel.cipher = session.next_stream(self.context)
        else:
            assert self.pending is not None
            try:
                self.channel.cipher, self.channel.session = self.handshake.finish(
                    self.pending, ready)
            except HandshakeError as exc:
                self.fail(f"it did not prove to be member {self.owner}: {exc}")
                self.channel.abort(f"refused READY: {exc}")
                return
        self.pending, self.unready = None, False
        self.answered.set()
        self._mark_ready()

    def stats(self) -> Stats | None:
        """This round's bytes on our stream to the owner (None: it never opened)."""
        if self.final is not None:
            return self.final
        return self.channel.stats() if self.channel is not None else None

    def in_flight(self, sent: int) -> int:
        return sent - (len(self.parts) - len(self.waiting))

    def on_close(self, exc: BaseException | None) -> None:
        """Closed without a word: its daemon is gone (or its round is over), so its parts will
        not come either; that holds even when all its results are in and it never connected
        to us as a sender, which would otherwise leave us waiting for the deadline. Closed
        after an ABORT: that said what happened, and is not counted again."""
        if self.failure is not None or self.told or self.busy:
            return
        if self.resumed and self.unready:  # a kept session that died idle (its peer
            self.stale = True              # restarted, or closed it): open a fresh one
            self.answered.set()
            return
        if isinstance(exc, TamperedFrame):  # the path, not necessarily its daemon, is bad
            self.fail(f"its results were tampered with: {exc}")
            return
        if self.waiting or (self.check is not None and not self.done.is_set()):
            self.fail(f"stream closed ({exc or 'EOF'})")
        self._exclusions.lost(self.owner, "its connection dropped", "disconnected")

    def fail(self, why: str) -> None:
        check = self.check
        if check is not None and check.verdict is None and not self.done.is_set():
            check.verdict = Verdict(False, f"the check did not finish: {why}")
            if not self.waiting:
                log.info("owner %d failed: %s; its span could not be checked and keeps local "
                         "values", self.owner, why)
        if self.failure is None and self.waiting:
            self.failure = why
            log.info("owner %d failed: %s; its %d remaining parts keep local values",
                     self.owner, why, len(self.waiting))
        self.done.set()
        self.progress.set()
        self.answered.set()
        self._mark_ready()

    def _recheck(self, index: int) -> None:
        """The owner refused our part as data: if our values are to blame, remember it."""
        p = self.plan.part(index)
        if p is not None and p.owner == self.owner and not self.ledger.closed:
            self.ledger.check(p)

    def _mark_ready(self) -> None:
        if not self._ready:
            self._ready = True
            self._gate.mark()
