"""The elastic queue's loading side: which unit to load next, and taking units over.

With ``resume=True`` or ``lease=`` a unit can change hands: released units, this learner's
units of an earlier incarnation, and units whose owner's lease expired are taken over with
``replace_if`` and read back (``queue.claims.read_back``), so exactly one node wins each.
The consuming side is ``queue.progress``. Details: docs/queue.md.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gradientmail.errors import RecordError, UnfinishedUnitsWarning
from gradientmail.layout import (
    CLAIMS_PREFIX,
    DONE_PREFIX,
    claim_key,
    learner_key,
    lease_key,
    work_key,
    work_prefix,
)
from gradientmail.mailbox.base import Mailbox, describe
from gradientmail.presence import RENEW_S, process_gone
from gradientmail.queue.claim_ahead import ClaimAhead
from gradientmail.queue.claimer import Claimer, Pick
from gradientmail.queue.claims import try_claim
from gradientmail.queue.crowd import CROWD_LIMIT
from gradientmail.queue.elastic_options import ElasticOptions
from gradientmail.queue.lease import UNREADABLE_LEASE, fence
from gradientmail.queue.liveness import POLL_S, LeaseWatch
from gradientmail.queue.pacing import BufferGauge
from gradientmail.queue.takeover import Assignment, take_over
from gradientmail.queue.unfinished import untracked_claims_error
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
from gradientmail.session.folded_units import close_slots
from gradientmail.verdict import LIVE, judge_lease

__all__ = ["ElasticClaimer"]

log = logging.getLogger("gradientmail.queue")


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
