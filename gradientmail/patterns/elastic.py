"""The elastic shared queue: completion and progress records, resume, leases and reclaim.

The seed's claims are permanent. With ``resume=True`` or ``lease=timedelta(...)`` (options of
``shared_queue`` and ``SharedQueueDataset``) the queue also records, in the same mailbox, what
the training loop has *consumed*, so that unfinished units can change hands:

- Progress: the consuming process (where the training loop runs) knows when a batch was
  consumed: when the loop asks for the next item after receiving it. ``ProgressTracker`` keeps
  the latest consumed batch per unit (its step label and its position in the unit's
  ``load()``) and a background thread writes it to ``work/{learner}/{identifier}`` (at most
  one write in flight, coalesced to the latest batch), so a crash loses at most the batches
  consumed since the last completed write. A unit's end is seen the same
  way (an end marker travels behind its last batch) and recorded as ``done/{identifier}``.
- Release: leaving the queue (the ``with`` block) flushes progress and rewrites every
  unfinished claim of this node as ``"released"`` with its last consumed step.
- Resume (``resume=True``): a node first takes over its own unfinished units of an earlier
  incarnation (one listing of ``work/{learner}/``), and units that any node released; it
  continues each from the first batch it had not consumed, counted by position in ``load()``'s
  iteration (step labels may repeat or go backwards).
- Leases (``lease=``): the tracker renews ``leases/{learner}.json`` only when batches were
  consumed since the previous renewal, so a node that is alive but stuck stops renewing too.
  A peer judges a lease expired when it has not changed for ``lease`` on the peer's *own* clock
  (immune to clock skew), and may then take over the owner's units.

Every takeover replaces the claim with ``replace_if`` (compare-and-swap: If-Match on S3, a
per-key lock on a directory) and reads it back, so exactly one node wins it; stores without
compare-and-swap are refused (``UnsafeStoreError``). Batches consumed by a node after its last
recorded progress and before it died (or was judged dead) are processed again by the node that
takes over: at-least-once for those batches, exactly-once for everything else.

Key layout and record formats: ``gradientmail.layout``.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from gradientmail.errors import UnsafeStoreError
from gradientmail.layout import (
    CLAIMS_PREFIX,
    DONE_PREFIX,
    claim_key,
    done_key,
    lease_key,
    work_key,
    work_prefix,
)
from gradientmail.mailbox.base import Mailbox, describe, require_replace_if
from gradientmail.patterns.claims import Claimer, Pick, claim_fields, parse_claim, try_claim
from gradientmail.records import CLAIM, LEASE, WORK, RecordError, RecordKind, SkippedRecords
from gradientmail.records import parse as parse_record

__all__ = [
    "Assignment",
    "ElasticClaimer",
    "ElasticOptions",
    "LeaseWatch",
    "ProgressTracker",
    "take_over",
]

ACTIVE, RELEASED = "active", "released"
RUNNING, STOPPED = "running", "stopped"
BATCH, END = 0, 1
"""Kinds of the tag carried beside each item between the loading side and the consumer."""

POLL_S = 0.05
"""Granularity of waits that must notice a stop request."""


# -- options -----------------------------------------------------------------------------------
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


def lease_seconds(lease: timedelta | float | None) -> float | None:
    """``lease`` in seconds (None: no leases); a clear error for anything else."""
    if lease is None:
        return None
    if isinstance(lease, bool) or not isinstance(lease, (timedelta, int, float)):
        raise TypeError(f"lease must be a datetime.timedelta (or seconds), not {type(lease).__name__}")
    seconds = lease.total_seconds() if isinstance(lease, timedelta) else float(lease)
    if not seconds > 0:
        raise ValueError(f"lease must be positive, not {lease!r}")
    return seconds


def check_elastic(mailbox: Mailbox, resume: object, lease: timedelta | float | None) -> float | None:
    """Validate ``resume`` / ``lease`` and refuse a store without compare-and-swap for them."""
    if not isinstance(resume, bool):
        raise TypeError(f"resume must be a bool, not {type(resume).__name__}")
    seconds = lease_seconds(lease)
    if resume or seconds is not None:
        feature = "resume=True" if resume else f"lease={lease!r}"
        require_replace_if(mailbox, feature)
    return seconds


# -- records -----------------------------------------------------------------------------------
def _dumps(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _record(kind: RecordKind, data: bytes | None) -> dict[str, Any] | None:
    """A bounded, validated record (``gradientmail.records``), or None: missing or unusable."""
    if data is None:
        return None
    try:
        return parse_record(kind, data)
    except RecordError:
        return None


def _step(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def work_body(
    learner_id: str, token: str, incarnation: str, step: int | None, done: bool = False, position: int | None = None
) -> bytes:
    return _dumps(
        {
            "learner": learner_id,
            "token": token,
            "incarnation": incarnation,
            "step": step,
            "position": position,
            "done": done,
            "updated": time.time(),
        }
    )


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
) -> Assignment | None:
    """Replace the claim on ``identifier`` with one of ours if ``expect(claim)`` holds.

    Reads the claim with its version, checks ``expect``, swaps in a claim with a fresh token
    (``replace_if``: exactly one of several racing callers wins), reads it back like the claim
    protocol does, and records the unit under ``work/{learner_id}/``. ``after(claim)`` gives the
    last step consumed before the takeover (default: the owner's work record, else the
    claim's ``step``), ``position(claim)`` that batch's position in ``load``'s iteration
    (default: recorded alongside the step; None when ``after`` is given without it). Returns
    None when the claim changed meanwhile or ``expect`` refused it.
    """
    key = claim_key(identifier)
    got = mailbox.get_versioned(key)
    if got is None:
        return None
    data, version = got
    claim = parse_claim(data)
    if claim is None or not expect(claim):
        return None
    owner = claim.get("learner") if isinstance(claim.get("learner"), str) else None
    if after is not None:
        start, start_position = after(claim), position(claim) if position is not None else None
    else:
        start, start_position = recorded_progress(mailbox, identifier, claim)
    token = uuid.uuid4().hex
    body = claim_fields(
        learner_id,
        token,
        worker,
        incarnation=incarnation,
        state=ACTIVE,
        step=start,
        position=start_position,
        taken_from=owner,
    )
    if not mailbox.replace_if(key, _dumps(body), version):
        return None
    read_back = mailbox.get(key)
    if read_back is None:
        store = describe(mailbox)
        raise UnsafeStoreError(
            f"{store}: the claim {key!r} was replaced but cannot be read back; "
            "this store does not show a write to the next read, so takeovers are unsafe here",
            operation="get",
            key=key,
            store=store,
        )
    mine = parse_claim(read_back)
    if mine is None or mine.get("token") != token:
        return None  # replaced again meanwhile, by someone else
    mailbox.put(
        work_key(learner_id, identifier), work_body(learner_id, token, incarnation, start, position=start_position)
    )
    if owner and owner != learner_id:
        try:  # the previous owner's record: keeps its listing small; harmless if it stays
            mailbox.delete(work_key(owner, identifier))
        except Exception:
            pass
    return Assignment(identifier, token, start, owner, start_position)


def recorded_step(mailbox: Mailbox, identifier: str, claim: Mapping[str, Any]) -> int | None:
    """The last step consumed under ``claim``: its owner's work record if it matches, else the
    step the claim was taken over or released at."""
    return recorded_progress(mailbox, identifier, claim)[0]


def recorded_progress(mailbox: Mailbox, identifier: str, claim: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """``(step, position)`` of the last batch consumed under ``claim``, from its owner's work
    record if it matches, else from the claim (taken over or released there)."""
    source: Mapping[str, Any] = claim
    if claim.get("state") != RELEASED and isinstance(claim.get("learner"), str):
        record = _record(WORK, mailbox.get(work_key(claim["learner"], identifier)))
        if record is not None and record.get("token") == claim.get("token"):
            source = record
    return _step(source.get("step")), _position(source.get("position"))


def _position(value: Any) -> int | None:
    step = _step(value)
    return step if step is not None and step >= 0 else None


# -- leases ------------------------------------------------------------------------------------
class LeaseWatch:
    """Judges peers' leases on this process's own monotonic clock.

    A lease is expired when its record has not changed for ``lease_s`` since this watch first
    saw that exact content, whatever the writer's clock says; a missing record counts as a
    record that never changes. A record that says the node stopped, or that names another
    incarnation than the claim's (the node restarted), is expired at once.
    """

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s = lease_s
        self.clock = clock
        self._seen: dict[str, tuple[bytes | None, float]] = {}

    def expired(self, learner: str, record: bytes | None, incarnation: str | None = None) -> bool:
        body = _record(LEASE, record)  # unusable: judged like a record that never changes
        if body is not None:
            if body.get("state") == STOPPED:
                return True
            if incarnation is not None and body.get("incarnation") != incarnation:
                return True
        now = self.clock()
        seen = self._seen.get(learner)
        if seen is None or seen[0] != record:
            self._seen[learner] = (record, now)
            return False
        return now - seen[1] >= self.lease_s


def lease_body(learner_id: str, incarnation: str, beat: int, consumed: int, lease_s: float, state: str) -> bytes:
    return _dumps(
        {
            "learner": learner_id,
            "incarnation": incarnation,
            "beat": beat,
            "consumed": consumed,
            "time": time.time(),
            "lease_s": lease_s,
            "state": state,
        }
    )


# -- the loading side: which unit next ---------------------------------------------------------
class _FreshClaimer(Claimer):
    """The seed's ``Claimer``, writing elastic claim bodies and remembering each won token."""

    def __init__(self, *args: Any, incarnation: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.incarnation = incarnation
        self.token: str | None = None

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
            self.token = pick.token  # claims run one at a time here (no ClaimAhead on the elastic path)
        return won


class ElasticClaimer:
    """Picks this learner's next unit: its own unfinished ones, released or orphaned ones, fresh ones.

    Order of preference: units handed over by ``restore`` (``load_state_dict``) and, with
    ``resume``, this learner's units of an earlier incarnation (one listing of
    ``work/{learner}/``); then units found by a *scan* (released units, and with leases units
    whose owner's lease expired); then fresh units through the seed's claim protocol. A scan
    lists ``units/`` and ``done/`` and reads the claims of unfinished units; it runs when the
    claimer starts, with leases at most every ``lease/2`` while fresh units last, and when they
    run out: without leases once more, with leases every ``lease/2`` until every unit is done
    or held by this incarnation (a peer may still die), or until ``stopping()``.
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
        restore: Mapping[str, Mapping[str, Any]] | None = None,
        stopping: Callable[[], bool] = lambda: False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.mailbox = mailbox
        self.order = list(order)
        self.learner_id = learner_id
        self.options = options
        self.worker = worker
        self.stopping = stopping
        self.clock = clock
        self._fresh = _FreshClaimer(
            mailbox,
            self.order,
            learner_id,
            worker=worker,
            listing=listing,
            incarnation=options.incarnation,
        )
        self._watch = LeaseWatch(options.lease_s, clock) if options.lease_s else None
        self._restore = dict(restore or {})
        self._own: list[str] | None = None if options.resume else []
        # Scans serve resume and leases; a claimer that only restores a state_dict never scans.
        self._scans = options.resume or options.lease_s is not None
        self._next_scan = clock() if self._scans else float("inf")  # scan when starting
        self._fresh_left = True
        self._candidates: list[tuple[str, Any]] = []
        self._pending = False
        self._claims_seen: dict[tuple[str, Any], float] = {}  # (unit, token) -> first seen
        self.skipped = SkippedRecords(f"learner {learner_id!r}")
        """Unusable claims, work records and leases met (counted, warned once per kind and learner)."""
        self.stats: dict[str, int] = {"claims": 0, "takeovers": 0, "scans": 0}

    @property
    def claim_stats(self) -> Any:
        return self._fresh.stats

    # -- public ------------------------------------------------------------------------------
    def claim_next(self) -> Assignment | None:
        """The next unit this claimer owns, or None when there is nothing left to take."""
        while self._restore:
            identifier, state = self._restore.popitem()
            found = self._take(
                identifier,
                expect=_restorable(self.learner_id, state),
                after=lambda claim, state=state: _step(state.get("step")),
                position=lambda claim, state=state: _position(state.get("position")),
            )
            if found is not None:
                return found
        if self._own is None:
            self._own = self._own_units()
        while self._own:
            identifier = self._own.pop(0)
            found = self._take(identifier, expect=self._own_earlier)
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
            identifier = self._fresh.claim_next()
            if identifier is not None:
                self.stats["claims"] += 1
                assert self._fresh.token is not None
                token = self._fresh.token
                self.mailbox.put(
                    work_key(self.learner_id, identifier),
                    work_body(self.learner_id, token, self.options.incarnation, None),
                )
                return Assignment(identifier, token)
            self._fresh_left = False
        return self._drain()

    # -- internals ---------------------------------------------------------------------------
    def _take(
        self,
        identifier: str,
        *,
        expect: Callable[[dict[str, Any]], bool],
        after: Callable[[dict[str, Any]], int | None] | None = None,
        position: Callable[[dict[str, Any]], int | None] | None = None,
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
        )
        if found is not None:
            self.stats["takeovers"] += 1
        return found

    def _own_units(self) -> list[str]:
        """This learner's unfinished units of earlier incarnations (one listing, one GET each)."""
        prefix = work_prefix(self.learner_id)
        found = []
        for key in self.mailbox.list(prefix):
            record = self.skipped.parse(WORK, self.mailbox.get(key), key, self.learner_id)
            if record is None or record.get("incarnation") == self.options.incarnation:
                continue  # unusable (warned), or a sibling worker's current unit
            found.append(key[len(prefix) :])
        rank = {identifier: position for position, identifier in enumerate(self.order)}
        return sorted((i for i in found if i in rank), key=rank.__getitem__)

    def _own_earlier(self, claim: dict[str, Any]) -> bool:
        return (
            claim.get("learner") == self.learner_id and claim.get("incarnation") != self.options.incarnation
        ) or claim.get("state") == RELEASED

    def _take_candidate(self) -> Assignment | None:
        while self._candidates:
            identifier, token = self._candidates.pop(0)
            found = self._take(identifier, expect=lambda claim, token=token: claim.get("token") == token)
            if found is not None:
                return found
            self._pending = True  # another node took it first; it is not done yet
        return None

    def _drain(self) -> Assignment | None:
        """No fresh unit is left: take what becomes free, or stop."""
        if not self._scans:
            return None
        while True:
            self._scan()
            found = self._take_candidate()
            if found is not None:
                return found
            if self._watch is None or not self._pending:
                return None
            while self.clock() < self._next_scan:
                if self.stopping():
                    return None
                time.sleep(min(POLL_S, max(0.0, self._next_scan - self.clock())))

    def _scan(self) -> None:
        """Collect released and orphaned units (in preference order) as candidates."""
        self.stats["scans"] += 1
        interval = self.options.lease_s / 2 if self.options.lease_s else float("inf")
        self._next_scan = self.clock() + interval
        claimed = {key[len(CLAIMS_PREFIX) :] for key in self.mailbox.list(CLAIMS_PREFIX)}
        done = {key[len(DONE_PREFIX) :] for key in self.mailbox.list(DONE_PREFIX)}
        leases: dict[str, bytes | None] = {}
        self._pending = False
        self._candidates = []
        for identifier in self.order:
            if identifier not in claimed or identifier in done:
                continue
            key = claim_key(identifier)
            claim = self.skipped.parse(CLAIM, self.mailbox.get(key), key)
            if claim is None or claim.get("incarnation") == self.options.incarnation:
                continue  # unusable (warned; nobody can take it over), or being worked on by this node
            if self._takeable(identifier, claim, leases):
                self._candidates.append((identifier, claim.get("token")))
            else:
                self._pending = True

    def _takeable(self, identifier: str, claim: dict[str, Any], leases: dict[str, bytes | None]) -> bool:
        if claim.get("state") == RELEASED:
            return True
        owner = claim.get("learner")
        if self.options.resume and owner == self.learner_id:
            return True  # our own unit of an earlier incarnation
        if self._watch is None or not isinstance(owner, str):
            return False
        # The claim itself must also have stayed the same for a whole lease: a node that has
        # just taken a unit over renews its lease only once it consumes from it.
        now = self.clock()
        first_seen = self._claims_seen.setdefault((identifier, claim.get("token")), now)
        if owner not in leases:  # one read per owner and scan
            leases[owner] = self.mailbox.get(lease_key(owner))
            self.skipped.parse(LEASE, leases[owner], lease_key(owner), owner)  # counted and warned
        incarnation = claim.get("incarnation") if isinstance(claim.get("incarnation"), str) else None
        if not self._watch.expired(owner, leases[owner], incarnation):
            return False
        record = _record(LEASE, leases[owner])
        gone = record is not None and (
            record.get("state") == STOPPED or (incarnation is not None and record.get("incarnation") != incarnation)
        )
        return gone or now - first_seen >= self._watch.lease_s


def _restorable(learner_id: str, state: Mapping[str, Any]) -> Callable[[dict[str, Any]], bool]:
    token = state.get("token")

    def expect(claim: dict[str, Any]) -> bool:
        if token is not None:
            return claim.get("token") == token
        return claim.get("learner") == learner_id and claim.get("state") != RELEASED

    return expect


# -- the consuming side: what the training loop has consumed -----------------------------------
class ProgressTracker:
    """Records consumed steps, finished units and the lease heartbeat from the consuming process.

    ``consumed`` and ``finished`` only update memory; one background thread writes, one request
    at a time, always the latest state (a unit's progress is coalesced to its last consumed
    step). ``close`` flushes, releases this incarnation's unfinished units and marks the lease
    stopped. A write that fails is kept and raised by the next ``check``; the thread goes on.
    """

    def __init__(self, mailbox: Any, learner_id: str, options: ElasticOptions) -> None:
        self.mailbox = mailbox
        self.learner_id = learner_id
        self.options = options
        self._changed = threading.Condition()
        self._progress: dict[str, tuple[str, int, int | None]] = {}
        self._finished: list[tuple[str, str]] = []
        self._consumed = 0
        self._beat_consumed = 0
        self._beat = 0
        self._last_beat = 0.0
        self._stopping = False
        self._writing = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.writes: dict[str, int] = {"progress": 0, "done": 0, "lease": 0, "released": 0}
        self.skipped = SkippedRecords(f"learner {learner_id!r}")

    # -- called by the consumer -----------------------------------------------------------
    def start(self) -> None:
        if self.options.lease_s is not None:
            self._write_lease(RUNNING)
        self._thread = threading.Thread(target=self._run, name=f"gradientmail-progress-{self.learner_id}", daemon=True)
        self._thread.start()

    def consumed(self, identifier: str, token: str, step: int, position: int | None = None) -> None:
        """The loop consumed the batch labelled ``step`` at ``position`` of the unit's load()."""
        with self._changed:
            self._progress[identifier] = (token, step, position)
            self._consumed += 1
            self._changed.notify_all()

    def finished(self, identifier: str, token: str) -> None:
        with self._changed:
            self._finished.append((identifier, token))
            self._changed.notify_all()

    def check(self) -> None:
        """Raise the error of a failed background write (once)."""
        error, self._error = self._error, None
        if error is not None:
            raise error

    def flush(self) -> None:
        """Wait until everything recorded so far is written."""
        with self._changed:
            self._changed.wait_for(lambda: self._idle() or self._thread is None or not self._thread.is_alive())

    def close(self, *, release: bool = True) -> None:
        """Flush, stop the writer, release unfinished units of this incarnation, stop the lease."""
        if self._thread is not None:
            with self._changed:
                self._stopping = True
                self._changed.notify_all()
            self._thread.join()
            self._thread = None
        if release:
            self.release()
        if self.options.lease_s is not None:
            self._write_lease(STOPPED)

    def release(self) -> int:
        """Rewrite this incarnation's unfinished claims as released; returns how many."""
        released = 0
        prefix = work_prefix(self.learner_id)
        for key in list(self.mailbox.list(prefix)):
            record = self.skipped.parse(WORK, self.mailbox.get(key), key, self.learner_id)
            if record is None or record.get("incarnation") != self.options.incarnation:
                continue
            identifier = key[len(prefix) :]
            got = self.mailbox.get_versioned(claim_key(identifier))
            claim = parse_claim(got[0]) if got is not None else None
            if claim is not None and claim.get("token") == record.get("token"):
                claim.update(
                    state=RELEASED,
                    step=_step(record.get("step")),
                    position=_position(record.get("position")),
                    released_at=time.time(),
                )
                if self.mailbox.replace_if(claim_key(identifier), _dumps(claim), got[1]):
                    released += 1
            self.mailbox.delete(key)
        self.writes["released"] += released
        return released

    # -- the writer thread ------------------------------------------------------------------
    def _idle(self) -> bool:
        return not self._progress and not self._finished and not self._writing

    def _beat_due(self) -> float | None:
        """Seconds until the next heartbeat may be written (None: nothing to renew)."""
        lease = self.options.lease_s
        if lease is None or self._consumed == self._beat_consumed:
            return None
        return max(0.0, self._last_beat + lease / 4 - time.monotonic())

    def _run(self) -> None:
        while True:
            with self._changed:
                self._writing = False
                self._changed.notify_all()
                while True:
                    due = self._beat_due()
                    if self._progress or self._finished or due == 0.0:
                        break
                    if self._stopping:
                        return
                    self._changed.wait(due)
                progress, self._progress = self._progress, {}
                finished, self._finished = self._finished, []
                beat = self._beat_due() == 0.0
                self._writing = True
            try:
                self._write(progress, finished, beat)
            except Exception as exc:  # surfaced to the consumer by check()
                self._error = exc

    def _write(
        self, progress: dict[str, tuple[str, int, int | None]], finished: list[tuple[str, str]], beat: bool
    ) -> None:
        done = {identifier for identifier, _ in finished}
        if beat:
            self._write_lease(RUNNING)
        for identifier, (token, step, position) in progress.items():
            if identifier in done:
                continue  # the done record below supersedes it
            self.mailbox.put(
                work_key(self.learner_id, identifier),
                work_body(self.learner_id, token, self.options.incarnation, step, position=position),
            )
            self.writes["progress"] += 1
        for identifier, token in finished:
            claim = parse_claim(self.mailbox.get(claim_key(identifier)))
            if claim is not None and claim.get("token") == token:
                # Another node that took the unit over (this one was judged dead) finishes it.
                record = {"learner": self.learner_id, "token": token, "at": time.time()}
                self.mailbox.put_if_absent(done_key(identifier), _dumps(record))
                self.writes["done"] += 1
            self.mailbox.delete(work_key(self.learner_id, identifier))

    def _write_lease(self, state: str) -> None:
        lease = self.options.lease_s
        assert lease is not None
        with self._changed:
            self._beat += 1
            self._beat_consumed = self._consumed
            self._last_beat = time.monotonic()
            beat, consumed = self._beat, self._consumed
        self.mailbox.put(
            lease_key(self.learner_id),
            lease_body(self.learner_id, self.options.incarnation, beat, consumed, lease, state),
        )
        self.writes["lease"] += 1


# -- the stream between the two sides ----------------------------------------------------------
Tagged = tuple[Any, Any, tuple[str, str, int, Any]]
"""``(step, tensor, (identifier, token, BATCH, position))`` or ``(None, None, (identifier, token,
END, None))``; ``position`` is the batch's index in the unit's ``load()`` iteration."""


def tagged_items(
    claimer: ElasticClaimer,
    load_unit: Callable[[str], Iterator[tuple[int, Any]]],
    on_claim: Callable[[], None] = lambda: None,
) -> Iterator[Tagged]:
    """Each owned unit's batches not consumed before (``Assignment.skips``), then an end marker,
    unit by unit; each batch tagged with its position in ``load``'s iteration."""
    while True:
        assignment = claimer.claim_next()
        if assignment is None:
            return
        on_claim()
        identifier, token = assignment.identifier, assignment.token
        for position, (step, tensor) in enumerate(load_unit(identifier)):
            if assignment.skips(step, position):
                continue
            yield step, tensor, (identifier, token, BATCH, position)
        yield None, None, (identifier, token, END, None)


class Consumption:
    """Turns tagged items into ``(step, tensor)`` and tells the tracker what was consumed.

    A batch counts as consumed when the next item is asked for (the loop trained on it), or
    when ``close(consumed_last=True)`` says so (the ``with`` block was left without an error).
    """

    def __init__(self, tracker: ProgressTracker) -> None:
        self.tracker = tracker
        self._last: tuple[str, str, int, int | None] | None = None

    def next_from(self, items: Iterator[Tagged]) -> tuple[int, Any]:
        self.tracker.check()
        if self._last is not None:
            self.tracker.consumed(*self._last)
            self._last = None
        while True:
            step, tensor, tag = next(items)
            identifier, token, kind = tag[0], tag[1], tag[2]
            if kind == END:
                self.tracker.finished(identifier, token)
                continue
            self._last = (identifier, token, step, tag[3] if len(tag) > 3 else None)
            return step, tensor

    def finish(self, *, consumed_last: bool) -> None:
        if consumed_last and self._last is not None:
            self.tracker.consumed(*self._last)
        self._last = None


def consume_inline(
    items: Iterator[Tagged], tracker: ProgressTracker, presence: Any = None
) -> Iterator[tuple[int, Any]]:
    """Direct iteration of a dataset in this process: the generator resuming means consumed.

    ``presence`` (a ``presence.Presence``) registers this incarnation first and is closed last.
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
    try:
        while True:
            try:
                item = consumption.next_from(items)
            except StopIteration:
                return
            yield item
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            close()
        consumption.finish(consumed_last=False)
        try:
            tracker.close()
        finally:
            if presence is not None:
                presence.close()
