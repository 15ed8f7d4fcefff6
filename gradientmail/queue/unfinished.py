"""Units an earlier run left claimed and not finished: the warnings and the error that say so.

A restart of a learner id finds what its previous incarnation left in ``work/``; without
``resume=True`` nothing continues those units, so saying so is the only way they are not lost
silently. Details: docs/elastic.md.
"""

from __future__ import annotations

import logging
import warnings

from gradientmail.errors import UnfinishedUnitsWarning, UntrackedClaimsError
from gradientmail.layout import (
    work_prefix,
)
from gradientmail.mailbox.base import Mailbox
from gradientmail.records import (
    STOPPED,
    PresenceRecord,
    SkippedRecords,
    WorkRecord,
)

__all__ = [
    "untracked_claims_error",
    "untracked_record",
    "warn_unclean",
    "warn_unfinished",
]

log = logging.getLogger("gradientmail.queue")


def untracked_record(learner_id: str, incarnation: str) -> bytes:
    """The ``work/{learner}/{identifier}`` body the design note's queue writes while it loads a
    unit: what ``status`` and a restart of this learner read as claimed and not finished."""
    return WorkRecord.new(learner_id, incarnation, incarnation, None, untracked=True).to_bytes()


def warn_unfinished(mailbox: Mailbox, learner_id: str, incarnation: str) -> int:
    """Warn when an earlier run of ``learner_id`` left units claimed and not finished, which
    the design note's queue cannot take back; returns how many (one listing of ``work/``).

    A warning, not an error: the queue was chosen (``resume=False``) or forced (a DataLoader
    worker cannot see the loop, a store without ``replace_if``), the run can go on with the
    other units, and refusing would leave the user no way to finish it under this prefix.
    """
    prefix = work_prefix(learner_id)
    skipped = SkippedRecords(f"learner {learner_id!r}")
    units = []
    for key in mailbox.list(prefix):
        record = skipped.fetch(WorkRecord, mailbox, key, learner_id)
        if record is not None and record.incarnation != incarnation:
            units.append(key[len(prefix) :])
    if units:
        shown = ", ".join(units[:5]) + (", ..." if len(units) > 5 else "")
        message = (
            f"learner {learner_id!r}: {len(units)} unit(s) claimed by an earlier run of this learner "
            f"were left unfinished ({shown}) and this queue does not take them back: it records no "
            "consumed batch (resume=False, a DataLoader worker, or a store without replace_if), so "
            "their untrained batches are not trained in this run. To take them back, run the "
            "queue through shared_queue(...) or iterate the dataset in the training process, with "
            "the default resume=None on a store with replace_if, from the start of a fresh prefix"
        )
        log.warning("%s", message)
        warnings.warn(message, UnfinishedUnitsWarning, stacklevel=3)
    return len(units)


def warn_unclean(learner_id: str, previous: PresenceRecord | None) -> bool:
    """With ``resume=False`` nothing records a unit's progress: warn when the previous run of
    ``learner_id`` (its presence record, read at registration) did not leave cleanly, since the
    units it held then stay claimed and untrained; returns whether it warned."""
    if previous is None or previous.state == STOPPED:
        return False
    message = (
        f"learner {learner_id!r}: its previous run (host {previous.host!r}, pid {previous.pid}) did "
        "not leave cleanly: the units it had claimed and not finished stay claimed and are not "
        "trained in this run. resume=False records no progress, so how many is unknown; the "
        "default resume=None records it and a restart takes them back"
    )
    log.warning("%s", message)
    warnings.warn(message, UnfinishedUnitsWarning, stacklevel=3)
    return True


def untracked_claims_error(learner_id: str, identifier: str, store: str) -> UntrackedClaimsError:
    """What a resuming learner raises on its own claim written by the design note's queue."""
    return UntrackedClaimsError(
        f"{store}: unit {identifier!r} was claimed by learner {learner_id!r} through the design "
        "note's queue (resume=False, or a DataLoader worker), which records no consumed batch: "
        "resuming cannot know which of its batches were trained, and taking it back would train "
        "them all again. Continue this run with resume=False (its claims stay as they are), or "
        "start the run again under a fresh prefix"
    )
