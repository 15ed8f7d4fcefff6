"""The elastic queue's loading side: which unit to load next, and taking units over.

Section ``takeover`` below: Taking one unit over: the elastic counterpart of ``queue.claims.try_claim``.

A takeover swaps the claim with ``replace_if`` (compare-and-swap: exactly one of several racing
nodes wins) and reads it back like a claim; the new owner continues after the last batch the
previous owner recorded as consumed (``work/{learner}/{identifier}``), or after the last one the
run's state holds from it when that is further (``session.folded_units``: a learner that died
after a fold, before writing its record).

Section ``reclaim`` below: The elastic queue's loading side: which unit to load next, and taking units over.

With ``resume=True`` or ``lease=`` a unit can change hands: released units, this learner's
units of an earlier incarnation, and units whose owner's lease expired are taken over with
``replace_if`` and read back (``queue.claims.read_back``), so exactly one node wins each.
The consuming side is ``queue.progress``. Details: docs/queue.md.
"""

from __future__ import annotations

import logging
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from gradientmail.errors import RecordError, UnfinishedUnitsWarning, UntrackedClaimsError
from gradientmail.fold_gate import UnitMark, held_everywhere
from gradientmail.layout import (
    CLAIMS_PREFIX,
    DONE_PREFIX,
    claim_key,
    done_key,
    learner_key,
    lease_key,
    work_key,
    work_prefix,
)
from gradientmail.mailbox.base import Mailbox, describe, exists, require_replace_if, supports_replace_if
from gradientmail.presence import RENEW_S, process_gone
from gradientmail.queue.claimer import CROWD_LIMIT, ClaimAhead, Claimer, Pick
from gradientmail.queue.claims import claim_record, load_claim, read_back, try_claim
from gradientmail.queue.lease import UNREADABLE_LEASE, fence
from gradientmail.queue.liveness import POLL_S, LeaseWatch, lease_seconds
from gradientmail.queue.pacing import BufferGauge
from gradientmail.records import (
    ACTIVE,
    FENCED,
    RELEASED,
    STOPPED,
    ClaimRecord,
    LeaseRecord,
    PresenceRecord,
    SkippedRecords,
    WorkRecord,
    get_record_versioned,
)
from gradientmail.session.folded_units import close_slots, folded_mark
from gradientmail.verdict import LIVE, judge_lease

__all__ = [
    "Assignment",
    "ElasticClaimer",
    "ElasticOptions",
    "check_elastic",
    "elastic_options",
    "recorded_progress",
    "recorded_step",
    "take_over",
    "untracked_record",
    "warn_unclean",
    "warn_unfinished",
]

log = logging.getLogger("gradientmail.queue")


# -- unfinished ---------------------------------------------------------------------------------------


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


# -- takeover ----------------------------------------------------------------------------------------


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


def recorded_step(mailbox: Mailbox, identifier: str, claim: Mapping[str, Any] | ClaimRecord) -> int | None:
    """The last step consumed under ``claim``: its owner's work record if it matches, else the
    step the claim was taken over or released at."""
    return recorded_progress(mailbox, identifier, claim)[0]


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


# -- reclaim -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ElasticOptions:
    """What a dataset carries into its workers when resume or leases are on.

    ``incarnation`` names one run of a learner (a fresh ``uuid4`` each time a queue is
    iterated), so that a restarted node tells its own earlier, dead self's units from the
    units its current workers hold.
    """

    resume: bool
    lease_s: float | None
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex)
    automatic: bool = False
    """Chosen by ``resume=None`` (the default), not asked for: a clean exit keeps this learner's
    unfinished units reserved for it (``releases``), and where consumption cannot be seen (a
    DataLoader worker) the dataset falls back to the design note's queue instead of refusing."""
    joined_marks: tuple[tuple[UnitMark, ...], ...] | None = None
    """This learner's unit marks per fragment as its Session read them when joining (its counts
    continue from that read), for taking its earlier incarnation's units back; None: read the
    store (``FoldGate.take_join_marks``)."""

    @property
    def releases(self) -> bool:
        """Whether a clean exit releases unfinished units to any node: asked for with
        ``resume=True`` or ``lease=``; the automatic mode keeps them for this learner id (the
        design note's reservations stay permanent, only their owner takes them back)."""
        return not self.automatic or self.lease_s is not None


def check_elastic(mailbox: Mailbox, resume: object, lease: timedelta | float | None) -> float | None:
    """Validate ``resume`` / ``lease`` and refuse a store without compare-and-swap for them.

    ``resume=None`` (automatic) needs nothing: without ``replace_if`` it is the design note's queue.
    """
    if resume is not None and not isinstance(resume, bool):
        raise TypeError(f"resume must be True, False or None (automatic), not {type(resume).__name__}")
    seconds = lease_seconds(lease)
    if resume or seconds is not None:
        feature = "resume=True" if resume else f"lease={lease!r}"
        require_replace_if(mailbox, feature)
    return seconds


def elastic_options(mailbox: Mailbox, resume: bool | None, lease_s: float | None) -> ElasticOptions | None:
    """The elastic options ``resume`` and ``lease_s`` ask for (None: the design note's queue).

    ``resume=None`` keeps the resume bookkeeping wherever the store has ``replace_if``, so a
    learner restarted under the same id takes its unfinished units back exactly.
    """
    if resume is None:
        if supports_replace_if(mailbox):
            return ElasticOptions(True, lease_s, automatic=True)
        resume = False
    if resume or lease_s is not None:
        return ElasticOptions(resume, lease_s)
    return None


class _FreshClaimer(Claimer):
    """The design note's ``Claimer``, writing elastic claim bodies and each won unit's ``work/`` record.

    Attempts may run on ``ClaimAhead``'s threads: each won token is kept by identifier, and the
    work record is written before the unit is handed out, so a unit claimed ahead is already
    this incarnation's for ``status`` and for a restart."""

    def __init__(self, *args: Any, incarnation: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.incarnation = incarnation
        self.tokens: dict[str, str] = {}

    def attempt(self, pick: Pick) -> bool:
        won = try_claim(
            self.mailbox,
            pick.identifier,
            self.learner_id,
            worker=self.worker,
            token=pick.token,
            incarnation=self.incarnation,
            state=ACTIVE,
            step=None,
        )
        if won:
            self.mailbox.put(
                work_key(self.learner_id, pick.identifier),
                WorkRecord.new(self.learner_id, pick.token, self.incarnation, None).to_bytes(),
            )
            self.tokens[pick.identifier] = pick.token
        return won


AWAIT_RESCAN_S = 2.0
"""Seconds between scans of a claimer with nothing left to claim that waits for a takeover
(``lease/2`` when shorter): it notices promptly that the unit became takeable, that its owner
renewed its lease, or that it is done."""

SCANS_PER_LEASE = 64
"""The most scans such a claimer makes per lease: with a long lease the rescans space out,
bounding what a wait costs (a scan lists ``units/`` and ``done/``)."""

TAKEABLE, HELD, AWAITED = "takeable", "held", "awaited"
"""What a scan makes of an unfinished claim of another incarnation (``ElasticClaimer.judge``)."""


class ElasticClaimer:
    """Picks this learner's next unit: its own unfinished ones, released or orphaned ones, fresh ones.

    Order of preference: units handed over by ``restore`` (``load_state_dict``) and, with
    ``resume``, this learner's units of an earlier incarnation (one listing of
    ``work/{learner}/``); then units found by a *scan* (released units, and with leases units
    whose owner's lease expired); then fresh units through the design note's claim protocol. A scan
    lists ``units/`` and ``done/`` and reads the claims of unfinished units; it runs when the
    claimer starts, with leases at most every ``lease/2`` while fresh units last, and once more
    when they run out.

    Then the claimer stops as soon as every unit is done, this incarnation's, or held by a node
    whose lease is live: the lease bounds how long a dead node's units wait, not how long live
    nodes wait at the end. It waits (rescanning every ``AWAIT_RESCAN_S``) only while a unit's
    takeover is under way: its owner's lease expired, or does not vouch for it
    (``LeaseWatch.vouches``), and the claim has not yet stood still a whole lease. Without
    leases it never waits. ``stopping()`` ends a wait; ``clock`` (monotonic) and ``sleep`` are
    injectable for tests.
    """

    def __init__(
        self,
        mailbox: Any,
        order: Sequence[str],
        learner_id: str,
        options: ElasticOptions,
        *,
        worker: int | None = None,
        listing: str = "adaptive",
        crowd_limit: float = CROWD_LIMIT,
        restore: Mapping[str, Mapping[str, Any]] | None = None,
        stopping: Callable[[], bool] = lambda: False,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        claim_ahead: int = 0,
        gauge: BufferGauge | None = None,
    ) -> None:
        self.mailbox = mailbox
        self.order = list(order)
        self.learner_id = learner_id
        self.options = options
        self.worker = worker
        self.stopping = stopping
        self.clock = clock
        self.sleep = sleep
        self._fresh = _FreshClaimer(
            mailbox,
            self.order,
            learner_id,
            worker=worker,
            listing=listing,
            crowd_limit=crowd_limit,
            incarnation=options.incarnation,
        )
        # Fresh units claimed ahead on background threads (the automatic mode; ``resume=True``
        # and ``lease=`` claim on demand): a claim's round trips then overlap loading.
        self._ahead = ClaimAhead(
            self._fresh,
            limit=claim_ahead if options.automatic else 0,
            gauge=gauge,
            name=f"gradientmail-claim-{learner_id}",
        )
        self._watch = LeaseWatch(options.lease_s, clock) if options.lease_s else None
        self._restore = dict(restore or {})
        self._own: list[str] | None = None if options.resume else []
        # Scans serve resume and leases; a claimer that only restores a state_dict never scans.
        self._scans = options.resume or options.lease_s is not None
        self._next_scan = clock() if self._scans else float("inf")  # scan when starting
        self._fresh_left = True
        self._candidates: list[tuple[str, Any]] = []
        self._awaited: list[str] = []  # units whose takeover the last scan found under way
        self._claims_seen: dict[tuple[str, Any], float] = {}  # (unit, token) -> first seen
        self._closed: set[tuple[str, str | None]] = set()  # (owner, incarnation) whose slots it closed
        self._held_by: Counter[str] = Counter()  # owner -> unfinished units the last scan left to it
        self._warned_held = False
        self.skipped = SkippedRecords(f"learner {learner_id!r}")
        """Unusable claims, work records and leases met (counted, warned once per kind and learner)."""
        self.stats: dict[str, int] = {"claims": 0, "takeovers": 0, "scans": 0}

    @property
    def claim_stats(self) -> Any:
        return self._fresh.stats

    def unclaimed(self) -> int:
        """Fresh units not known to be claimed, plus the released or orphaned ones found and not taken."""
        return self._fresh.unclaimed() + len(self._candidates)

    # -- public ------------------------------------------------------------------------------
    def claim_next(self) -> Assignment | None:
        """The next unit this claimer owns, or None when there is nothing left to take."""
        while self._restore:
            identifier, state = self._restore.popitem()
            found = self._take(
                identifier,
                expect=_restorable(self.learner_id, state),
                after=lambda claim, state=state: _step_value(state.get("step")),
                position=lambda claim, state=state: _position_value(state.get("position")),
            )
            if found is not None:
                return found
        if self._own is None:
            self._own = self._own_units()
            if self._own:
                logging.getLogger("gradientmail.queue").info(
                    "%s: resuming %d unfinished unit(s) of its earlier run, each after its last batch "
                    "in the run's state (%s)",
                    self.learner_id,
                    len(self._own),
                    ", ".join(self._own[:3]) + (", ..." if len(self._own) > 3 else ""),
                )
        while self._own:
            identifier = self._own.pop(0)
            found = self._take(
                identifier, expect=lambda claim, identifier=identifier: self._own_earlier(claim, identifier)
            )
            if found is not None:
                return found
        found = self._take_candidate()
        if found is not None:
            return found
        if self.clock() >= self._next_scan:
            self._scan()
            found = self._take_candidate()
            if found is not None:
                return found
        if self._fresh_left:
            identifier = self._ahead.next()
            if identifier is not None:
                self.stats["claims"] += 1
                return Assignment(identifier, self._fresh.tokens.pop(identifier))
            self._fresh_left = False
        return self._drain()

    def close(self) -> None:
        """Stop claiming ahead and wait for the claims in flight (units won stay claimed, with
        their ``work/`` records: this learner's restart takes them back)."""
        self._ahead.close()

    # -- internals ---------------------------------------------------------------------------
    def _take(
        self,
        identifier: str,
        *,
        expect: Callable[[ClaimRecord], bool],
        after: Callable[[ClaimRecord], int | None] | None = None,
        position: Callable[[ClaimRecord], int | None] | None = None,
    ) -> Assignment | None:
        found = take_over(
            self.mailbox,
            identifier,
            self.learner_id,
            self.options.incarnation,
            expect=expect,
            after=after,
            worker=self.worker,
            position=position,
            joined_marks=self.options.joined_marks,
            skipped=self.skipped,
        )
        if found is not None:
            self.stats["takeovers"] += 1
        return found

    def _own_units(self) -> list[str]:
        """This learner's unfinished units of earlier incarnations (one listing, one GET each)."""
        prefix = work_prefix(self.learner_id)
        found = []
        for key in self.mailbox.list(prefix):
            record = self.skipped.fetch(WorkRecord, self.mailbox, key, self.learner_id)
            if record is None or record.incarnation == self.options.incarnation:
                continue  # unusable (warned), or a sibling worker's current unit
            found.append(key[len(prefix) :])
        rank = {identifier: position for position, identifier in enumerate(self.order)}
        return sorted((i for i in found if i in rank), key=rank.__getitem__)

    def _own_earlier(self, claim: ClaimRecord, identifier: str) -> bool:
        if claim.learner == self.learner_id and claim.incarnation is None and claim.state != RELEASED:
            raise untracked_claims_error(self.learner_id, identifier, describe(self.mailbox))
        return (
            claim.learner == self.learner_id and claim.incarnation != self.options.incarnation
        ) or claim.state == RELEASED

    def _take_candidate(self) -> Assignment | None:
        while self._candidates:
            identifier, token = self._candidates.pop(0)
            found = self._take(identifier, expect=lambda claim, token=token: claim.token == token)
            if found is not None:
                return found
            # Lost: the claim changed (another node took it, or its owner marked it in use).
        return None

    def _drain(self) -> Assignment | None:
        """No fresh unit is left: take what is free, wait while a takeover is under way, else stop.

        Every unit is claimed by now, so a scan sees every unit that could still come free.
        """
        if not self._scans:
            return None
        while True:
            self._scan()
            found = self._take_candidate()
            if found is not None:
                return found
            if self._watch is None or not self._awaited:
                self._warn_held()
                return None  # every unit is done, this incarnation's, or held by another node
            rescan = self.clock() + self.await_rescan_s
            while self.clock() < rescan:
                if self.stopping():
                    return None
                self.sleep(min(POLL_S, max(0.0, rescan - self.clock())))

    def _warn_held(self) -> None:
        """Nothing is left for this node: say so when units are held unfinished by a learner that
        is not live (stopped, or its presence record not renewed for three intervals): without a
        lease nobody else may take them, so they are never trained unless that id comes back."""
        if self._warned_held or not self._held_by:
            return
        self._warned_held = True
        for owner, count in sorted(self._held_by.items()):
            if owner == self.learner_id:
                continue
            why = _not_live(self.mailbox, owner)
            if why is None:
                continue
            message = (
                f"learner {self.learner_id!r} found nothing left to claim, but learner {owner!r} holds "
                f"{count} unfinished unit(s) and {why}: without a lease no other learner may take them "
                f"over, so their batches are not trained unless learner {owner!r} restarts (the same "
                "learner_id, e.g. GRADIENTMAIL_LEARNER_ID, on any host) or the nodes run with lease=; "
                "`gradientmail status` lists them"
            )
            log.warning("%s", message)
            warnings.warn(message, UnfinishedUnitsWarning, stacklevel=2)

    @property
    def await_rescan_s(self) -> float:
        """Seconds between scans while waiting for a takeover at the end (``AWAIT_RESCAN_S``)."""
        lease = self.options.lease_s
        if lease is None:
            return float("inf")
        return min(lease / 2, max(AWAIT_RESCAN_S, lease / SCANS_PER_LEASE))

    def _scan(self) -> None:
        """Collect released and orphaned units (in preference order) as candidates."""
        self.stats["scans"] += 1
        interval = self.options.lease_s / 2 if self.options.lease_s else float("inf")
        self._next_scan = self.clock() + interval
        claimed = {key[len(CLAIMS_PREFIX) :] for key in self.mailbox.list(CLAIMS_PREFIX)}
        done = {key[len(DONE_PREFIX) :] for key in self.mailbox.list(DONE_PREFIX)}
        leases: dict[str, _SeenLease] = {}
        self._awaited = []
        self._candidates = []
        self._held_by = Counter()
        for identifier in self.order:
            if identifier not in claimed or identifier in done:
                continue
            key = claim_key(identifier)
            claim = self.skipped.fetch(ClaimRecord, self.mailbox, key)
            if claim is None or claim.incarnation == self.options.incarnation:
                continue  # unusable (warned; nobody can take it over), or being worked on by this node
            verdict = self.judge(identifier, claim, leases)
            if verdict == TAKEABLE:
                self._candidates.append((identifier, claim.token))
            elif verdict == AWAITED:
                self._awaited.append(identifier)

    def takeable(
        self, identifier: str, claim: Mapping[str, Any] | ClaimRecord, leases: dict[str, _SeenLease] | None = None
    ) -> bool:
        """Whether ``claim`` on ``identifier`` may be taken over now (``judge`` says ``TAKEABLE``)."""
        return self.judge(identifier, claim, leases) == TAKEABLE

    def judge(
        self, identifier: str, claim: Mapping[str, Any] | ClaimRecord, leases: dict[str, _SeenLease] | None = None
    ) -> str:
        """``TAKEABLE``, ``AWAITED`` or ``HELD``: what a claimer makes of ``claim`` on ``identifier``.

        ``TAKEABLE``: released, this learner's own of an earlier incarnation (with resume), its
        owner's lease stopped, fenced or restarted, or expired while the claim itself stood still
        for a whole lease, once this claimer fenced that lease (``queue.lease.fence``: an owner's
        beat that lands first makes the fence fail, and nothing is taken). A fenced owner's next
        pending contribution slots are closed first (``_close_slots``).
        ``AWAITED``: a takeover is under way: the owner's lease expired but the claim has not
        stood still a whole lease yet, or the lease, live on this clock, does not vouch for its
        writer (``LeaseWatch.vouches``: first read just now and old by its writer's clock).
        ``HELD``: its owner is alive (its beat beat the fence), or nobody can take it over (no
        leases, no owner). ``leases`` caches each owner's lease within a scan.
        """
        if leases is None:
            leases = {}
        record = ClaimRecord.of(claim)
        if record.state == RELEASED:
            return TAKEABLE
        owner = record.learner
        if record.incarnation is None:  # the design note's claim: how far it went is unknown
            if self.options.resume and owner == self.learner_id:
                raise untracked_claims_error(self.learner_id, identifier, describe(self.mailbox))
            self._held_by[owner or "?"] += 1
            return HELD
        if self.options.resume and owner == self.learner_id:
            return TAKEABLE  # our own unit of an earlier incarnation
        if self._watch is None or owner is None:
            self._held_by[owner or "?"] += 1
            return HELD
        # The claim itself must also have stayed the same for a whole lease: a node that has
        # just taken a unit over renews its lease only once it consumes from it.
        now = self.clock()
        first_seen = self._claims_seen.setdefault((identifier, record.token), now)
        if owner not in leases:  # one read per owner and scan
            try:
                got = get_record_versioned(self.mailbox, lease_key(owner), LeaseRecord.KIND)
            except RecordError as exc:  # too large to be a lease: an unusable one (see ``fence``)
                self.skipped.skip(LeaseRecord.KIND, exc, owner)
                got = UNREADABLE_LEASE
            leases[owner] = _SeenLease(got)
            if got is not UNREADABLE_LEASE:
                self.skipped.read(LeaseRecord, leases[owner].data, lease_key(owner), owner)  # counted and warned
        seen = leases[owner]
        incarnation = record.incarnation
        if not self._watch.expired(owner, seen.data, incarnation):
            return HELD if self._watch.vouches(owner, seen.data) else AWAITED
        # Stopped, fenced or restarted (judged from the record alone) frees the unit at once.
        lease = LeaseRecord.read(seen.data)
        if lease is not None and judge_lease(lease, self._watch.lease_s, incarnation=incarnation) != LIVE:
            if lease.state == FENCED and lease.incarnation == incarnation:
                self._close_slots(owner, incarnation)  # fenced by another peer: maybe not closed yet
            return TAKEABLE
        if now - first_seen < self._watch.lease_s:
            return AWAITED
        if seen.fenced is None:  # one fence per owner and scan
            seen.fenced = fence(self.mailbox, owner, seen.got, self.learner_id, self._watch.lease_s, incarnation)
            if seen.fenced:
                self._close_slots(owner, incarnation)
        return TAKEABLE if seen.fenced else HELD  # a failed fence: the owner's beat came first

    def _close_slots(self, owner: str, incarnation: str | None) -> None:
        """Before any of ``owner``'s marks are read: close its next pending contribution slots
        (``session.folded_units.close_slots``), once per owner and incarnation; a fold it may
        still write (frozen between its beat and the write) then lands nowhere."""
        if (owner, incarnation) not in self._closed:
            close_slots(self.mailbox, owner, self.learner_id)
            self._closed.add((owner, incarnation))


@dataclass
class _SeenLease:
    """An owner's lease as one scan read it (body and version, None: missing), and whether this
    claimer fenced it (None: not tried)."""

    got: tuple[bytes, str] | None
    fenced: bool | None = None

    @property
    def data(self) -> bytes | None:
        return None if self.got is None else self.got[0]


PRESENCE_MISSED = 3
"""Renewal intervals a presence record may miss before its learner counts as not live here."""


def _not_live(mailbox: Mailbox, learner: str) -> str | None:
    """Why ``learner`` does not look live from its presence record, or None when it does."""
    record = PresenceRecord.fetch(mailbox, learner_key(learner))
    if record is None:
        return "has no presence record (it never ran a queue here, or it is unreadable)"
    if record.state == STOPPED:
        return "left the run"
    if process_gone(record):
        return f"its process (pid {record.pid} on this machine) is gone"
    renew_s = record.renew_s or RENEW_S
    age = time.time() - record.time if record.time is not None else None
    if age is not None and age > PRESENCE_MISSED * renew_s:
        return f"was last seen {age:.0f} s ago (it renews every {renew_s:g} s: it may be dead)"
    return None


def _step_value(value: Any) -> int | None:
    """``value`` if it is an int step label (not a bool), else None: a state_dict is user input."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _position_value(value: Any) -> int | None:
    """``value`` if it is a batch position (an int >= 0), else None."""
    step = _step_value(value)
    return step if step is not None and step >= 0 else None


def _restorable(learner_id: str, state: Mapping[str, Any]) -> Callable[[ClaimRecord], bool]:
    token = state.get("token")

    def expect(claim: ClaimRecord) -> bool:
        if token is not None:
            return claim.token == token
        return claim.learner == learner_id and claim.state != RELEASED

    return expect
