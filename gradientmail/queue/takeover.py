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

from gradientmail.claim_record import ClaimRecord
from gradientmail.fold_gate import UnitMark, held_everywhere
from gradientmail.layout import claim_key, done_key, work_key
from gradientmail.mailbox.base import Mailbox
from gradientmail.queue.claims import claim_record, load_claim, read_back
from gradientmail.queue.leases import ACTIVE, RELEASED, position_value, read_record, step_value, work_body
from gradientmail.records import WORK
from gradientmail.session.folded_units import folded_mark

__all__ = ["Assignment", "recorded_progress", "recorded_step", "take_over"]


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
    expect: Callable[[dict[str, Any]], bool] = lambda claim: True,
    after: Callable[[dict[str, Any]], int | None] | None = None,
    worker: int | None = None,
    position: Callable[[dict[str, Any]], int | None] | None = None,
    joined_marks: Sequence[Sequence[UnitMark]] | None = None,
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
    ``FoldGate.take_join_marks``).

    Returns:
        The ``Assignment``, or None when the claim changed meanwhile or ``expect`` refused it.

    Raises:
        UnsafeStoreError: the replaced claim cannot be read back.
    """
    key = claim_key(identifier)
    got = mailbox.get_versioned(key)
    if got is None:
        return None
    data, version = got
    record = load_claim(data)
    if record is None:
        return None
    claim = record.to_dict()  # what the callbacks are documented to get
    if not expect(claim):
        return None
    owner = record.learner
    if after is not None:
        start, start_position = after(claim), position(claim) if position is not None else None
    else:
        start, start_position = recorded_progress(mailbox, identifier, record)
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
    if mailbox.get(done_key(identifier)) is not None:
        # Finished meanwhile: its owner writes ``done`` after checking the claim is still its own,
        # so a unit done before the swap is seen here (a scan's listing of done units ages).
        return None
    if after is None and owner is not None and record.state != RELEASED and record.token:
        # Read only now that the claim is ours: an owner checks its claim before each fold that
        # holds unrecorded batches, so nothing it folds after these reads goes unseen. The marks
        # first, then the record again: an owner that was still going (slow, not dead) may have
        # folded and recorded batches since the read above, and a fold after its record carries
        # no mark for them: one of the two reads sees every batch it folded before the swap.
        if owner == learner_id and record.incarnation != incarnation and joined_marks is not None:
            mark = held_everywhere(joined_marks, identifier, record.token)
        else:
            mark = folded_mark(mailbox, owner, identifier, record.token)
        again, again_position = recorded_progress(mailbox, identifier, record)
        for step, at in ((mark.step, mark.position) if mark is not None else (None, None), (again, again_position)):
            if at is not None and (start_position is None or at > start_position):
                start, start_position = step, at
    mailbox.put(
        work_key(learner_id, identifier), work_body(learner_id, token, incarnation, start, position=start_position)
    )
    if owner and owner != learner_id:
        try:  # the previous owner's record: keeps its listing small; harmless if it stays
            mailbox.delete(work_key(owner, identifier))
        except Exception:
            pass
    return Assignment(identifier, token, start, owner, start_position)


def recorded_step(mailbox: Mailbox, identifier: str, claim: Mapping[str, Any] | ClaimRecord) -> int | None:
    """The last step consumed under ``claim``: its owner's work record if it matches, else the
    step the claim was taken over or released at."""
    return recorded_progress(mailbox, identifier, claim)[0]


def recorded_progress(
    mailbox: Mailbox, identifier: str, claim: Mapping[str, Any] | ClaimRecord
) -> tuple[int | None, int | None]:
    """``(step, position)`` of the last batch consumed under ``claim``, from its owner's work
    record if it matches, else from the claim (taken over or released there)."""
    record = ClaimRecord.of(claim)
    if record.state != RELEASED and record.learner is not None:
        work = read_record(WORK, mailbox.get(work_key(record.learner, identifier)))
        if work is not None and work.get("token") == record.fields.get("token"):
            return step_value(work.get("step")), position_value(work.get("position"))
    return record.step, record.position
