"""Taking one unit over: the elastic counterpart of ``queue.claims.try_claim``.

A takeover swaps the claim with ``replace_if`` (compare-and-swap: exactly one of several racing
nodes wins) and reads it back like a claim; the new owner continues after the last batch the
previous owner recorded as consumed (``work/{learner}/{identifier}``), or after the last one the
run's state holds from it when that is further (``session.folded_units``: a learner that died
after a fold, before writing its record).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gradientmail.errors import RecordError
from gradientmail.fold_gate import UnitMark, held_everywhere
from gradientmail.layout import (
    claim_key,
    done_key,
    work_key,
)
from gradientmail.mailbox.base import Mailbox, exists
from gradientmail.queue.claims import claim_record, load_claim, read_back
from gradientmail.records import (
    ACTIVE,
    RELEASED,
    ClaimRecord,
    SkippedRecords,
    WorkRecord,
    get_record_versioned,
)
from gradientmail.session.folded_units import folded_mark

__all__ = [
    "Assignment",
    "recorded_progress",
    "take_over",
]


@dataclass(frozen=True)
class Assignment:
    """A unit this claimer now owns: load it and skip the batches consumed before.

    Those are the batches at positions ``<= position`` of ``load``'s iteration (steps are labels
    and may repeat); a record of an older version without a position is continued by its step
    label instead, skipping every step ``<= after`` (best effort). None: nothing to skip.
    """

    identifier: str
    token: str
    after: int | None = None
    taken_from: str | None = None
    position: int | None = None

    def skips(self, step: int, position: int) -> bool:
        """Whether the batch at ``position`` (labelled ``step``) was consumed before."""
        if self.position is not None:
            return position <= self.position
        return self.after is not None and step <= self.after


def take_over(
    mailbox: Any,
    identifier: str,
    learner_id: str,
    incarnation: str,
    *,
    expect: Callable[[ClaimRecord], bool] = lambda claim: True,
    after: Callable[[ClaimRecord], int | None] | None = None,
    worker: int | None = None,
    position: Callable[[ClaimRecord], int | None] | None = None,
    joined_marks: Sequence[Sequence[UnitMark]] | None = None,
    skipped: SkippedRecords | None = None,
) -> Assignment | None:
    """Replace the claim on ``identifier`` with one of ours if ``expect(claim)`` holds.

    Reads the claim with its version, checks ``expect``, swaps in a claim with a fresh token
    (``replace_if``: exactly one of several racing callers wins), reads it back like the claim
    protocol does, and records the unit under ``work/{learner_id}/``. ``after(claim)`` gives the
    last step consumed before the takeover (default: the owner's work record, else the
    claim's ``step``), ``position(claim)`` that batch's position in ``load``'s iteration
    (default: recorded alongside the step; None when ``after`` is given without it).
    ``joined_marks``: this learner's unit marks per fragment as its Session read them when
    joining, used instead of the store's for its own earlier incarnation's claims (see
    ``FoldGate.take_join_marks``). The callbacks get the claim as a ``ClaimRecord``: its declared
    fields, each checked. ``skipped`` counts and warns about an unusable claim or work record
    (None: they are skipped silently).

    Returns:
        The ``Assignment``, or None when the claim changed meanwhile or ``expect`` refused it.

    Raises:
        UnsafeStoreError: the replaced claim cannot be read back.
    """
    key = claim_key(identifier)
    try:
        got = get_record_versioned(mailbox, key, ClaimRecord.KIND)
    except RecordError:
        got = None  # too large to be a claim: unreadable, so nobody can take it over
    if got is None:
        return None
    data, version = got
    record = load_claim(data) if skipped is None else skipped.read(ClaimRecord, data, key)
    if record is None or not expect(record):
        return None
    owner = record.learner
    if after is not None:
        start, start_position = after(record), position(record) if position is not None else None
    else:
        start, start_position = recorded_progress(mailbox, identifier, record, skipped)
    token = uuid.uuid4().hex
    body = claim_record(
        learner_id,
        token,
        worker,
        incarnation=incarnation,
        state=ACTIVE,
        step=start,
        position=start_position,
        taken_from=owner,
    )
    if not mailbox.replace_if(key, body.to_bytes(), version):
        return None
    if not read_back(mailbox, key, token, action="replaced", what="takeovers"):
        return None  # replaced again meanwhile, by someone else
    if exists(mailbox, done_key(identifier)):
        # Finished meanwhile: its owner writes ``done`` after checking the claim is still its own,
        # so a unit done before the swap is seen here (a scan's listing of done units ages).
        return None
    if after is None and owner is not None and record.state != RELEASED and record.token:
        # Read only now that the claim is ours: an owner whose lease was fenced (``queue.lease``)
        # folds nothing more, and one whose lease stood still for a whole lease folds nothing
        # that lands after the fence, so nothing it folds goes unseen by these reads. The marks
        # first, then the record again: an owner that was still going (slow, not dead) may have
        # folded and recorded batches since the read above, and a fold after its record carries
        # no mark for them: one of the two reads sees every batch it folded before the swap.
        if owner == learner_id and record.incarnation != incarnation and joined_marks is not None:
            mark = held_everywhere(joined_marks, identifier, record.token)
        else:
            mark = folded_mark(mailbox, owner, identifier, record.token)
        again, again_position = recorded_progress(mailbox, identifier, record, skipped)
        for step, at in ((mark.step, mark.position) if mark is not None else (None, None), (again, again_position)):
            if at is not None and (start_position is None or at > start_position):
                start, start_position = step, at
    mailbox.put(
        work_key(learner_id, identifier),
        WorkRecord.new(learner_id, token, incarnation, start, position=start_position).to_bytes(),
    )
    if owner and owner != learner_id:
        try:  # the previous owner's record: keeps its listing small; harmless if it stays
            mailbox.delete(work_key(owner, identifier))
        except Exception:
            pass
    return Assignment(identifier, token, start, owner, start_position)


def recorded_progress(
    mailbox: Mailbox,
    identifier: str,
    claim: Mapping[str, Any] | ClaimRecord,
    skipped: SkippedRecords | None = None,
) -> tuple[int | None, int | None]:
    """``(step, position)`` of the last batch consumed under ``claim``, from its owner's work
    record if it matches, else from the claim (taken over or released there); ``skipped``
    counts and warns about an unusable work record."""
    record = ClaimRecord.of(claim)
    if record.state != RELEASED and record.learner is not None:
        key = work_key(record.learner, identifier)
        work = (
            WorkRecord.fetch(mailbox, key)
            if skipped is None
            else skipped.fetch(WorkRecord, mailbox, key, record.learner)
        )
        if work is not None and work.token == record.token:
            return work.step, work.position
    return record.step, record.position
