"""A learner's lease as a fence: written by its owner by compare-and-swap only, fenced by a taker.

With ``lease=``, peers take over the units of a node whose lease record
(``leases/{learner}.json``) stood still for a whole lease on their own clock. The node may only be
slow (a store that answers late, a busy machine) or frozen; it must then fold none of the batches
its taker trains again. Three rules make that hold with one read and one compare-and-swap per
fold, however many units the node holds:

- The owner writes its record only by compare-and-swap on the version it last wrote
  (``OwnLease``: the renewals, the *beat* right before each fold that holds batches whose records
  are not written, the stop at exit). A write that finds anything else raises ``LeaseLostError``:
  this process lost its units and folds nothing more.
- A taker first rewrites the record it judged stale, by compare-and-swap on the very version it
  judged, to ``FENCED`` naming itself (``fence``), and only then takes units over. Of an owner's
  beat and a taker's fence exactly one lands: a beat first makes the fence fail (the taker takes
  nothing), a fence first makes every later write of the owner fail. Both read the record back
  after a compare-and-swap that succeeded (``mailbox.confirmed``): on a store that can tell two
  writers they both won (SeaweedFS, docs/mailboxes.md), the one whose body is not stored lost.
- A beat restarts the taker's wait for a whole lease, so a fold written right after its beat
  lands before any fence. An owner frozen between its beat and its write would send the write
  after the fence: before it reads what the run holds of the owner's units, the taker closes the
  owner's next pending contribution slots (``session.folded_units.close_slots``, called by
  ``queue.reclaim``), and such a late write finds its key taken.

The record's fields: ``records.LeaseRecord``; the verdict on it: ``verdict.judge_lease``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from gradientmail.errors import LeaseLostError, RecordError
from gradientmail.layout import lease_key
from gradientmail.mailbox.confirmed import create_confirmed, replace_confirmed
from gradientmail.records import FENCED, LeaseRecord, get_record_versioned
from gradientmail.verdict import LIVE, judge_lease

__all__ = ["UNREADABLE_LEASE", "WRITE_ATTEMPTS", "OwnLease", "fence"]

log = logging.getLogger("gradientmail.queue")

UNREADABLE_LEASE: tuple[bytes, str] = (b"", "")
"""What a lease key holding a value too large to be a lease reads as: no body, no version. No
owner can beat over it (its own read finds it foreign and it stops with ``LeaseLostError``), so
once it has stood still for a lease a taker counts it as fenced (``fence``)."""

WRITE_ATTEMPTS = 3
"""Compare-and-swap attempts of one lease write (only its owner rewrites a live record)."""


class OwnLease:
    """This incarnation's lease record, written by compare-and-swap only; safe across threads.

    Each ``write`` is a read and a compare-and-swap (or a create when the record is missing). The
    first write replaces what an earlier incarnation left; every later one replaces only the body
    this incarnation wrote last. Once a write or ``check`` found the record fenced or rewritten,
    the lease is lost for good: every later call raises the same ``LeaseLostError``.
    """

    def __init__(self, mailbox: Any, learner_id: str, incarnation: str, lease_s: float) -> None:
        self.mailbox = mailbox
        self.learner_id = learner_id
        self.incarnation = incarnation
        self.lease_s = lease_s
        self.key = lease_key(learner_id)
        self._lock = threading.Lock()  # one write or check at a time: renewals, beats, checks
        self._beat = 0
        self._written: bytes | None = None  # the body this incarnation wrote last
        self._sent: bytes | None = None  # the body of a write whose answer may have been lost
        self._lost: LeaseLostError | None = None

    @property
    def lost(self) -> bool:
        """Whether a peer fenced this lease (or another incarnation took it): nothing may be folded."""
        return self._lost is not None

    def write(self, state: str, consumed: int, paused_s: float | None = None) -> None:
        """Write a new beat (``RUNNING``) or the stop at exit (``STOPPED``).

        Args:
            state: The record's state.
            consumed: Batches this incarnation consumed so far (informative).
            paused_s: How long this process stood still before the write, for the error.

        Raises:
            LeaseLostError: the record is no longer the one this incarnation wrote (a peer fenced
                it to take the units over, or another process under this learner id wrote it).
        """
        with self._lock:
            if self._lost is not None:
                raise self._lost
            self._beat += 1
            body = LeaseRecord.new(
                self.learner_id, self.incarnation, self._beat, consumed, self.lease_s, state
            ).to_bytes()
            for _ in range(WRITE_ATTEMPTS):
                got = _read_versioned(self.mailbox, self.key)
                if got is not None and not self._ours(got[0]):
                    raise self._lose(got[0], paused_s)
                self._sent = body
                # Confirmed by a read-back (the body is unique: incarnation and beat): on a store that
                # can tell two writers they both won, a fence that landed instead is seen here.
                if got is None:  # never written, or removed: a taker would create its fence the same way
                    written = create_confirmed(self.mailbox, self.key, body)
                else:
                    written = replace_confirmed(self.mailbox, self.key, body, got[1])
                if written:
                    self._written, self._sent = body, None
                    return
            self._lost = LeaseLostError(
                f"learner {self.learner_id!r}: its lease record {self.key!r} kept changing while this process "
                f"renewed it ({WRITE_ATTEMPTS} attempts): another writer is at work there; it stops so that "
                "no batch is trained twice"
            )
            raise self._lost

    def check(self, paused_s: float | None = None) -> None:
        """One read: raise ``LeaseLostError`` if the record is no longer this incarnation's
        (after a pause of ``paused_s``: a process frozen past its lease finds it fenced)."""
        with self._lock:
            if self._lost is not None:
                raise self._lost
            if self._written is None:
                return  # not written yet: nothing to lose
            got = _read_versioned(self.mailbox, self.key)
            data = None if got is None else got[0]
            if data is not None and not self._ours(data):
                raise self._lose(data, paused_s)

    def _ours(self, data: bytes) -> bool:
        """Whether ``data`` is this incarnation's to replace: its last body (or one whose answer
        was lost), or before its first write anything but a fence of this incarnation."""
        if data == self._written or data == self._sent:
            return True
        if self._written is not None:
            return False
        record = LeaseRecord.read(data)
        return record is None or record.incarnation != self.incarnation or record.state != FENCED

    def _lose(self, data: bytes, paused_s: float | None) -> LeaseLostError:
        """Remember and return the error of a lease found fenced or rewritten (``data``)."""
        record = LeaseRecord.read(data)
        why = (
            f"while this process stood still for {paused_s:.1f} s"
            if paused_s is not None
            else "because its lease record lagged (a slow store, a stalled process or a pause)"
        )
        if record is not None and record.state == FENCED:
            what = (
                f"its lease was fenced by {record.fenced_by!r}, which takes its units over, {why} "
                f"(lease {self.lease_s:g} s: its peers judged it dead)"
            )
        elif record is not None and record.incarnation != self.incarnation:
            what = "another process under the same learner id took its lease and its units over"
        else:
            what = f"its lease record {self.key!r} was rewritten by another writer"
        self._lost = LeaseLostError(
            f"learner {self.learner_id!r}: {what}; it stops so that no batch is trained twice. Restart it "
            "with resume=True to continue the run; give it a longer lease if such pauses are expected"
        )
        return self._lost


def fence(
    mailbox: Any,
    learner: str,
    seen: tuple[bytes, str] | None,
    taker: str,
    lease_s: float,
    incarnation: str | None = None,
) -> bool:
    """Fence ``learner``'s lease for ``taker`` if it still holds what was judged stale.

    Args:
        mailbox: The shared store.
        learner: The owner judged dead.
        seen: The lease record's body and version as judged (None: it was missing).
        taker: The learner about to take the owner's units over; the fence names it.
        lease_s: The lease, to judge the record again when the fence does not land.
        incarnation: The owner's incarnation in the claims to be taken over.

    Returns:
        Whether the owner's units may be taken over now: this call fenced the record, or it was
        meanwhile fenced by another taker, stopped, or rewritten by another incarnation. False:
        the owner wrote it meanwhile (it is alive; its beat landed first).
    """
    key = lease_key(learner)
    if seen == UNREADABLE_LEASE:
        # Nothing to compare-and-swap on, and no beat of the owner can land there either.
        log.info("%s takes the units of %s over: its lease record is unreadable", taker, learner)
        return True
    record = None if seen is None else LeaseRecord.read(seen[0])
    if record is None:  # missing or unusable: a fence that names the owner all the same
        record = LeaseRecord({"learner": learner, **({"incarnation": incarnation} if incarnation else {})})
    body = record.replace(state=FENCED, fenced_by=taker, fenced_at=time.time()).to_bytes()
    # Confirmed by a read-back (the taker and the time make the body unique): an owner's beat that
    # landed instead, on a store that told both writers they won, makes this a lost race.
    if seen is None:
        fenced = create_confirmed(mailbox, key, body)
    else:
        fenced = replace_confirmed(mailbox, key, body, seen[1])
    if fenced:
        log.info("%s fenced the lease of %s (judged dead) to take its units over", taker, learner)
        return True
    got = _read_versioned(mailbox, key)
    now = None if got is None else LeaseRecord.read(got[0])
    return now is not None and judge_lease(now, lease_s, incarnation=incarnation) != LIVE


def _read_versioned(mailbox: Any, key: str) -> tuple[bytes, str] | None:
    """The lease at ``key`` read with the record bound; a value too large to be a lease reads as
    an empty body (nobody's lease: an owner finding it there has lost its record)."""
    try:
        return get_record_versioned(mailbox, key, LeaseRecord.KIND)
    except RecordError:
        return UNREADABLE_LEASE
