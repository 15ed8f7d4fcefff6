"""The elastic queue's consuming side: what the training loop has consumed, and heartbeats.

A batch counts as consumed when the loop asks for the next item. ``ProgressTracker`` writes
the latest consumed batch per unit, finished units and the lease renewals from one background
thread, and beats the lease right before the Session's folds (``queue.lease``);
``tagged_items`` / ``Consumption`` carry each batch's unit and position from the loading side
(``queue.reclaim``) to it. Details: docs/queue.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gradientmail.errors import LeaseLostError, RecordError
from gradientmail.fold_gate import UnitMark
from gradientmail.layout import claim_key, done_key, work_key, work_prefix
from gradientmail.mailbox.confirmed import replace_confirmed
from gradientmail.meeting_point import meeting_point
from gradientmail.queue.batch_checks import Item, UnitTag
from gradientmail.queue.claims import load_claim
from gradientmail.queue.elastic_options import ElasticOptions
from gradientmail.queue.lease import OwnLease
from gradientmail.queue.reclaim import ElasticClaimer
from gradientmail.records import (
    RELEASED,
    RUNNING,
    STOPPED,
    ClaimRecord,
    DoneRecord,
    SkippedRecords,
    WorkRecord,
    get_record_versioned,
)
from gradientmail.session.folded_units import folded_mark

__all__ = ["Consumption", "ProgressTracker", "consume_inline", "tagged_items"]
"""Kinds of the tag carried beside each item between the loading side and the consumer."""

log = logging.getLogger("gradientmail.queue")

SETTLE_AFTER_S = 10.0
"""A loop waiting this long for its next batch (``lease/4`` when shorter) while records wait for
the Session has the Session fold them: a node that waits at the run's end for a dead peer's unit
to come free must not have its own last units look unfinished (and be reclaimed) meanwhile."""

WRITE_CONCURRENCY = 8
"""Units whose records the writer writes at once: enough to hide a distant store's round trips
behind the loop, few enough for any store's per-client connection pool (botocore's is 10)."""


class ProgressTracker:
    """Records consumed steps, finished units and the lease heartbeat from the consuming process.

    ``consumed`` and ``finished`` only update memory; one background thread writes, always the
    latest state (a unit's progress is coalesced to its last consumed step), the records of
    different units side by side. ``close`` flushes, releases this incarnation's unfinished units and marks the lease
    stopped. A write that fails is kept and raised by the next ``check``; the thread goes on.
    Every lease write is a compare-and-swap (``OwnLease``): once a peer fenced the lease to take
    this learner's units over, renewals and beats raise ``LeaseLostError``.

    With a ``Session`` of the same learner in this process, records wait at its ``FoldGate``
    (``gradientmail.fold_gate``) until the batch's progress is in the run's state.
    """

    def __init__(self, mailbox: Any, learner_id: str, options: ElasticOptions) -> None:
        self.mailbox = mailbox
        self.learner_id = learner_id
        self.options = options
        self._changed = threading.Condition()
        # unit -> (token, step, position, gate index) and [(unit, token, gate index)]: to write
        self._progress: dict[str, tuple[str, int, int | None, int]] = {}
        self._finished: list[tuple[str, str, int]] = []
        self.gate = meeting_point(mailbox, learner_id).gate
        self._held: deque[tuple[int, tuple[str, str, int, int | None] | tuple[str, str]]] = deque()
        self._waiting_since: float | None = None  # the loop is inside next() since (monotonic)
        self._handed_at: float | None = None  # when the loop last got a batch (monotonic)
        self._settling = False  # the writer thread has the Session fold; the loop must not resume
        lease = options.lease_s
        self._settle_after_s = SETTLE_AFTER_S if lease is None else min(SETTLE_AFTER_S, lease / 4)
        self._consumed = 0
        self._beat_consumed = 0
        self._last_beat = 0.0
        self._stopping = False
        self._writing = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None  # side-by-side record writes (_write)
        self._ask_state = False  # releases read the units' marks from the run's state (close)
        self.writes: dict[str, int] = {"progress": 0, "done": 0, "lease": 0, "released": 0}
        self.skipped = SkippedRecords(f"learner {learner_id!r}")
        self.lease = (
            None if options.lease_s is None else OwnLease(mailbox, learner_id, options.incarnation, options.lease_s)
        )
        """This incarnation's lease record (``lease=``): renewals, beats before folds, the stop."""

    # -- called by the consumer -----------------------------------------------------------
    def start(self) -> None:
        self.gate.listen(self._folded)
        if self.options.lease_s is not None:
            self.gate.guard(self.check_owner, self.options.lease_s / 2, self.confirm_owner)
        if self.options.lease_s is not None:
            self._write_lease(RUNNING)
        self._thread = threading.Thread(target=self._run, name=f"gradientmail-progress-{self.learner_id}", daemon=True)
        self._thread.start()

    def consumed(
        self, identifier: str, token: str, step: int, position: int | None = None, index: int | None = None
    ) -> None:
        """The loop consumed the batch labelled ``step`` at ``position`` of the unit's load();
        ``index``: the batch's ``FoldGate`` index (its record waits until the run holds it)."""
        with self._changed:
            self._consumed += 1  # the lease's sign of life: consumption, folded or not
            if index is not None and (self._held or self.gate.holds(index)):
                self._held.append((index, (identifier, token, step, position)))
            else:
                self._progress[identifier] = (token, step, position, index or 0)
            self._changed.notify_all()

    def finished(self, identifier: str, token: str, index: int | None = None) -> None:
        """The unit's last batch (gate index ``index``) was consumed."""
        with self._changed:
            if index is not None and (self._held or self.gate.holds(index)):
                self._held.append((index, (identifier, token)))
            else:
                self._finished.append((identifier, token, index or 0))
            self._changed.notify_all()

    def _folded(self, folded: int | None) -> None:
        """The gate's listener: records of batches up to ``folded`` may be written now (None:
        the Session left without folding them; they are never written, and whoever continues
        those units trains them again)."""
        with self._changed:
            if folded is None:
                self._held.clear()
                return
            while self._held and self._held[0][0] <= folded:
                index, record = self._held.popleft()
                if len(record) == 4:
                    identifier, token, step, position = record
                    self._progress[identifier] = (token, step, position, index)
                else:
                    self._finished.append((record[0], record[1], index))
            self._changed.notify_all()

    def settle(self) -> None:
        """Before a clean close: have the Session fold what is held, so every record is written."""
        if self._held:
            self.gate.settle()
            self._folded(self.gate.folded)  # not only when the Session's thread tells us

    def waiting(self, waiting: bool) -> None:
        """The loop enters (True) or leaves (False) ``next()``. Leaving waits for a fold that the
        writer thread started meanwhile: the loop must not train while the model is snapshotted."""
        with self._changed:
            if waiting:
                self._waiting_since = time.monotonic()
                if self._held:  # the writer thread times the wait only while records wait
                    self._changed.notify_all()
            else:
                try:
                    self._changed.wait_for(lambda: not self._settling)
                finally:
                    self._waiting_since = None

    def confirm(self) -> None:
        """Before handing the next batch after the loop stood still for half a lease or more:
        check that peers did not judge this learner dead meanwhile.

        Peers reclaim a unit once its owner's lease has not changed for ``lease``; a process
        paused that long (SIGSTOP, a frozen VM) would otherwise finish the unit beside the node
        that took it over, and its Session would fold those batches a second time.

        Raises:
            LeaseLostError: a peer fenced this learner's lease to take its units over.
        """
        lease = self.options.lease_s
        now = time.monotonic()
        handed, self._handed_at = self._handed_at, now
        if lease is not None and handed is not None and now - handed >= lease / 2:
            self.check_owner(now - handed)

    def check_owner(self, paused_s: float | None = None) -> None:
        """Raise ``LeaseLostError`` if a peer fenced this learner's lease to take its units over
        (or another process of this learner took it): one read of the lease record."""
        if self.lease is not None:
            self.lease.check(paused_s)

    def confirm_owner(self) -> None:
        """Beat the lease (a read and a compare-and-swap, ``OwnLease.write``): the Session calls
        it right before a fold that holds batches whose records are not written. A peer that
        judged this learner dead must fence the lease before taking a unit over: the beat makes
        that fence fail, or finds the lease fenced and raises ``LeaseLostError``."""
        self._write_lease(RUNNING)

    def _settle_due(self) -> float | None:
        """Seconds until the writer thread has the Session fold for a waiting loop (None: never)."""
        if not self._held or self._waiting_since is None or not self.gate.attached:
            return None
        return max(0.0, self._waiting_since + self._settle_after_s - time.monotonic())

    @property
    def held(self) -> int:
        """Records waiting for the Session to fold their batches."""
        with self._changed:
            return len(self._held)

    def check(self) -> None:
        """Raise the error of a failed background write (once)."""
        error, self._error = self._error, None
        if error is not None:
            raise error

    def flush(self) -> None:
        """Wait until everything recorded so far is written."""
        with self._changed:
            self._changed.wait_for(lambda: self._idle() or self._thread is None or not self._thread.is_alive())

    def close(self, *, release: bool = True, replaced: bool = False, clean: bool = False) -> None:
        """Flush, stop the writer, release unfinished units of this incarnation, stop the lease.

        Records still held (batches whose progress is not in the run) are dropped: the units
        are released at the last batch the run holds, and whoever continues them trains the
        rest again. Unless ``clean`` (every batch delivered was recorded and folded), the Session
        first stops folding (``FoldGate.revoke``), so that those batches cannot reach the run
        from here as well. ``replaced``: another incarnation of this learner owns its records
        and its lease now; nothing more is written.
        """
        # A fold under way lands (its records follow) or is stopped; one that failed may still
        # have landed (a create whose answer was lost): releases then ask the run's state.
        self._ask_state = not clean and self.gate.revoke()
        self.gate.unlisten(self._folded)
        self.gate.guard(None)
        with self._changed:
            dropped, self._held = len(self._held), deque()
            if replaced:
                self._progress.clear()
                self._finished.clear()
                self._beat_consumed = self._consumed  # no heartbeat either
        if dropped:
            log.info(
                "%s: %d batch record(s) not written: their progress is not in the run's state; "
                "the node that continues those units trains them again",
                self.learner_id,
                dropped,
            )
        if self._thread is not None:
            with self._changed:
                self._stopping = True
                self._changed.notify_all()
            self._thread.join()
            self._thread = None
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if replaced:
            return
        if release and self.options.releases:  # the automatic mode keeps them for this learner id
            self.release()
        if self.lease is not None and not self.lease.lost:
            try:
                self._write_lease(STOPPED)
            except LeaseLostError as exc:  # fenced meanwhile: the taker's record stays
                log.info("%s: %s", self.learner_id, exc)

    def release(self) -> int:
        """Rewrite this incarnation's unfinished claims as released; returns how many."""
        released = 0
        prefix = work_prefix(self.learner_id)
        for key in list(self.mailbox.list(prefix)):
            record = self.skipped.fetch(WorkRecord, self.mailbox, key, self.learner_id)
            if record is None or record.incarnation != self.options.incarnation:
                continue
            identifier = key[len(prefix) :]
            try:
                got = get_record_versioned(self.mailbox, claim_key(identifier), ClaimRecord.KIND)
            except RecordError:
                got = None  # too large to be a claim: unreadable, not ours
            claim = load_claim(got[0]) if got is not None else None
            if claim is not None and claim.token == record.token:
                step, position = record.step, record.position
                marks = [self.gate.folded_mark(identifier)]  # the run holds a batch not recorded (the last)
                if self._ask_state:
                    try:
                        marks.append(folded_mark(self.mailbox, self.learner_id, identifier, claim.token))
                    except Exception as exc:  # released at the record: its batches may be trained twice
                        log.warning(
                            "%s: reading unit %r's marks from the run's state failed: %r",
                            self.learner_id,
                            identifier,
                            exc,
                        )
                for mark in marks:
                    if mark is not None and mark.token == claim.token and (mark.position or 0) > (position or -1):
                        step, position = mark.step, mark.position
                claim = claim.replace(state=RELEASED, step=step, position=position, released_at=time.time())
                # Confirmed by a read-back (the token and the time make the body unique): a takeover
                # that landed instead, on a store that told both writers they won, keeps the unit.
                if replace_confirmed(self.mailbox, claim_key(identifier), claim.to_bytes(), got[1]):
                    released += 1
            self.mailbox.delete(key)
        self.writes["released"] += released
        return released

    # -- the writer thread ------------------------------------------------------------------
    def _idle(self) -> bool:
        return not self._progress and not self._finished and not self._writing

    def beat_due(self) -> float | None:
        """Seconds until the next heartbeat may be written (None: nothing to renew)."""
        lease = self.options.lease_s
        if lease is None or self._consumed == self._beat_consumed or (self.lease is not None and self.lease.lost):
            return None
        return max(0.0, self._last_beat + lease / 4 - time.monotonic())

    def _run(self) -> None:
        while True:
            with self._changed:
                self._writing = False
                self._changed.notify_all()
                while True:
                    due, settle = self.beat_due(), self._settle_due()
                    if self._progress or self._finished or due == 0.0 or settle == 0.0:
                        break
                    if self._stopping:
                        return
                    waits = [d for d in (due, settle) if d is not None]
                    self._changed.wait(min(waits) if waits else None)
                self._writing = True
                self._settling = self._settle_due() == 0.0
                if not self._settling:
                    progress, self._progress = self._progress, {}
                    finished, self._finished = self._finished, []
                    beat = self.beat_due() == 0.0
            if self._settling:
                self._settle_for_waiting_loop()
                continue  # then write what the fold released, with the rest
            try:
                self._write(progress, finished, beat)
            except Exception as exc:  # surfaced to the consumer by check()
                self._error = exc

    def _settle_for_waiting_loop(self) -> None:
        """Have the Session fold while the loop waits inside ``next()`` (it cannot train now).

        A wait of half a lease or more may have been a freeze: the units must still be this
        learner's, else folding them would count batches its peers are training again."""
        try:
            since, lease = self._waiting_since, self.options.lease_s
            if since is not None and lease is not None and time.monotonic() - since >= lease / 2:
                self.check_owner(time.monotonic() - since)
            self.gate.settle()
        except Exception as exc:  # surfaced to the consumer by check()
            self._error = exc
        finally:
            with self._changed:
                self._settling = False
                if self._waiting_since is not None:  # still waiting: try again later, if still held
                    self._waiting_since = time.monotonic()
                self._changed.notify_all()

    def _write(
        self,
        progress: dict[str, tuple[str, int, int | None, int]],
        finished: list[tuple[str, str, int]],
        beat: bool,
    ) -> None:
        """Write records; each one written tells the gate that its unit needs no mark up to there.

        Units are independent, so their writes run side by side (``WRITE_CONCURRENCY`` at once):
        on a store 100 ms away a finished unit costs three round trips, and one after another
        they would fall behind a loop that finishes a unit every few batches, and make leaving
        the block wait for the backlog. Within a unit the order stays: the done record before
        the work record's deletion, so a crash between them leaves the unit finished, not lost.
        """
        done = {identifier for identifier, _, _ in finished}
        lost: LeaseLostError | None = None
        if beat:
            try:
                self._write_lease(RUNNING)
            except LeaseLostError as exc:  # raised once the records of folded batches are written
                lost = exc
        tasks: list[Callable[[], str | None]] = []
        for identifier, (token, step, position, index) in progress.items():
            if identifier not in done:  # the done record below supersedes it
                tasks.append(
                    lambda i=identifier, t=token, s=step, p=position, x=index: self._write_progress(i, t, s, p, x)
                )
        for identifier, token, index in finished:
            tasks.append(lambda i=identifier, t=token, x=index: self._write_done(i, t, x))
        for kind in self._run_side_by_side(tasks):
            if kind is not None:
                self.writes[kind] += 1
        if lost is not None:
            raise lost

    def _write_progress(self, identifier: str, token: str, step: int, position: int | None, index: int) -> str:
        self.mailbox.put(
            work_key(self.learner_id, identifier),
            WorkRecord.new(self.learner_id, token, self.options.incarnation, step, position=position).to_bytes(),
        )
        self.gate.written(identifier, index)
        return "progress"

    def _write_done(self, identifier: str, token: str, index: int) -> str | None:
        written = None
        claim = ClaimRecord.fetch(self.mailbox, claim_key(identifier))
        if claim is not None and claim.token == token:
            # Another node that took the unit over (this one was judged dead) finishes it.
            self.mailbox.put_if_absent(done_key(identifier), DoneRecord.new(self.learner_id, token).to_bytes())
            written = "done"
        self.gate.written(identifier, index)
        self.mailbox.delete(work_key(self.learner_id, identifier))
        return written

    def _run_side_by_side(self, tasks: list[Callable[[], str | None]]) -> list[str | None]:
        """Run ``tasks`` on the writer pool (one alone runs here); raise the first failure after
        every task ended, so one failed unit never stops the others' records."""
        if len(tasks) <= 1:
            return [task() for task in tasks]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                WRITE_CONCURRENCY, thread_name_prefix=f"gradientmail-records-{self.learner_id}"
            )
        futures = [self._pool.submit(task) for task in tasks]
        results, error = [], None
        for future in futures:
            try:
                results.append(future.result())
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error
        return results

    def _write_lease(self, state: str) -> None:
        """Renew the lease (``RUNNING``) or mark it stopped, by compare-and-swap (``OwnLease``).

        Raises:
            LeaseLostError: a peer fenced the lease: this learner's units are being taken over.
        """
        assert self.lease is not None
        with self._changed:
            self._beat_consumed = self._consumed
            self._last_beat = time.monotonic()
            consumed = self._consumed
        self.lease.write(state, consumed)
        self.writes["lease"] += 1


# -- the stream between the two sides ----------------------------------------------------------
def tagged_items(
    claimer: ElasticClaimer,
    load_unit: Callable[[str], Iterator[tuple[int, Any]]],
    on_claim: Callable[[], None] = lambda: None,
    turn: Callable[[], bool] | None = None,
) -> Iterator[Item]:
    """Each owned unit's batches not consumed before (``Assignment.skips``), unit by unit; each
    batch tagged with its claim token and its position in ``load``'s iteration.

    A unit's end rides on the next unit's first batch (``UnitTag.ended``): a separate end marker
    would take a place in the buffer, and with one-batch units half the buffer would hold no
    batch. An end marker of its own goes out only when no batch follows (the last unit).
    ``turn()`` is asked before each claim and waits for the loader's turn (``pacing.UnitPacer``);
    False ends the items (the loop has left)."""
    ended: tuple[str, str | None] | None = None
    while True:
        if turn is not None and not turn():
            return
        assignment = claimer.claim_next()
        if assignment is None:
            if ended is not None:
                yield Item(None, None, UnitTag(ended[0], ended[1], end=True))
            return
        on_claim()
        identifier, token = assignment.identifier, assignment.token
        for position, (step, tensor) in enumerate(load_unit(identifier)):
            if assignment.skips(step, position):
                continue
            yield Item(step, tensor, UnitTag(identifier, token, position, ended=ended))
            ended = None
        if ended is not None:  # a unit with nothing left to load: the earlier end goes out alone
            yield Item(None, None, UnitTag(ended[0], ended[1], end=True))
        ended = (identifier, token)


class Consumption:
    """Turns ``Item``s into ``(step, tensor)`` pairs and tells the tracker what was consumed.

    A batch counts as consumed when the next item is asked for (the loop trained on it), or
    when ``close(consumed_last=True)`` says so (the ``with`` block was left without an error).
    """

    def __init__(self, tracker: ProgressTracker) -> None:
        self.tracker = tracker
        self._last: tuple[str, str, int, int | None, int] | None = None
        self._index = 0  # the gate index of the last batch handed to the loop

    def next_from(self, items: Iterator[Item]) -> tuple[int, Any]:
        self.tracker.check()
        if self._last is not None:
            self.tracker.consumed(*self._last)
            self._last = None
        self.tracker.waiting(True)
        try:
            while True:
                step, tensor, tag = next(items)
                if tag.ended is not None:  # the unit before this batch's: all its batches consumed
                    self.tracker.finished(tag.ended[0], tag.ended[1], self._index)
                if not tag.end:
                    break
                self.tracker.finished(tag.unit, tag.token, self._index)
        finally:
            self.tracker.waiting(False)  # waits for a fold the writer thread started meanwhile
        identifier, token, position = tag.unit, tag.token, tag.position
        self.tracker.confirm()  # after a long pause: are its units still its own?
        # Counted only now: a fold under way when the batch arrived did not train on it.
        self._index = self.tracker.gate.deliver(UnitMark(identifier, token, step, position))
        self._last = (identifier, token, step, position, self._index)
        return step, tensor

    def finish(self, *, consumed_last: bool) -> None:
        if consumed_last and self._last is not None:
            self.tracker.consumed(*self._last)
        self._last = None


def consume_inline(items: Iterator[Item], tracker: ProgressTracker, presence: Any = None) -> Iterator[tuple[int, Any]]:
    """Direct iteration of a dataset in this process: the generator resuming means consumed.

    ``presence`` (a ``presence.PresenceShare``) registers this learner first and is closed last.
    """
    consumption = Consumption(tracker)
    if presence is not None:
        presence.start()  # DuplicateLearnerError before anything is claimed or recorded
    try:
        tracker.start()
    except BaseException:
        if presence is not None:
            presence.close()
        raise
    settled = False  # every unit done and every record folded: nothing for the Session to hold back
    try:
        while True:
            if presence is not None:
                presence.check()  # replaced by another incarnation of this learner: stop
            try:
                item = consumption.next_from(items)
            except StopIteration:  # every unit done: the Session folds what the records wait for
                tracker.settle()
                settled = True
                return
            yield item
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            close()
        consumption.finish(consumed_last=False)
        try:
            tracker.close(replaced=presence is not None and presence.replaced, clean=settled)
        finally:
            if presence is not None:
                presence.close()
