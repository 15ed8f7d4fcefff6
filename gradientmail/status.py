"""Read a run from its mailbox into plain data: what ``gradientmail status`` and ``plot`` show.

Read-only, from the documented records (``run.json``, claims, progress, ``done/``, ``leases/``,
``learners/``), so it works on any mailbox, during or after a run. Every record is read with the
record bound (``records.get_record``): a stray huge file is refused unread. Unusable records are listed in
``RunStatus.unreadable``; an unreadable claim still counts as claimed, under learner ``"?"``.
A learner whose process died without a lease says nothing more: its presence record (or,
lacking one, its progress record) stops being renewed, and ``LearnerStatus.may_be_dead`` says so.
"""

from __future__ import annotations

import math
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from gradientmail.errors import RecordError, RunNotFoundError
from gradientmail.layout import (
    CLAIMS_PREFIX,
    DONE_PREFIX,
    LEARNERS_PREFIX,
    LEASES_PREFIX,
    PROGRESS_PREFIX,
    RUN_KEY,
    WORK_PREFIX,
)
from gradientmail.mailbox.base import Mailbox, describe
from gradientmail.presence import presence_window_s
from gradientmail.records import (
    STOPPED,
    ClaimRecord,
    LeaseRecord,
    PresenceRecord,
    ProgressRecord,
    Record,
    RecordT,
    RunRecord,
    get_record,
)
from gradientmail.records import parse as parse_record
from gradientmail.verdict import CLOCK_TOLERANCE_S, EXPIRED, Sightings, judge_lease

DEFAULT_THREADS = 16
"""Parallel GETs when reading claim bodies; object stores answer each in tens of ms."""

FETCH_CHUNK = 2048
"""Records fetched per batch of parallel GETs: bodies are parsed and dropped batch by batch, so
a 100k-unit run never holds 100k bodies (or 100k futures) at once."""

UNKNOWN_LEARNER = "?"
"""Learner name shown for a claim whose body cannot be parsed."""

SILENT_PROGRESS_S = 600.0
"""A learner with a progress record but no presence record (a writer that keeps none) may be
dead once its ``last_seen`` is this much older than the reader's clock (plus
``CLOCK_TOLERANCE_S``): a progress record names no renewal interval, and a Session writes one per
round of exchanges (30 s by default), so only a long silence says anything."""


class Fetched(NamedTuple):
    """One record as read: its body (None: missing or refused), or why it was refused."""

    key: str
    body: bytes | None
    problem: str | None = None
    """What is wrong with it when it was refused unread (longer than a record may hold)."""


@dataclass(frozen=True)
class Unreadable:
    """A record that could not be used (``gradientmail.records``): its key and what is wrong."""

    key: str
    problem: str


@dataclass(frozen=True, slots=True)
class Claim:
    """One ``units/{identifier}`` claim body (fields missing from the body are None).

    Slotted, with its names interned: a 100k-unit run holds 100k of them.
    """

    identifier: str
    learner: str
    claimed_at: float | None = None
    host: str | None = None
    pid: int | None = None
    worker: Any = None
    state: str | None = None
    """``"active"`` or ``"released"`` for claims of elastic runs, None for the design note's claims."""
    incarnation: str | None = None

    @classmethod
    def from_record(cls, identifier: str, record: ClaimRecord) -> Claim:
        """The claim on ``identifier`` as ``record`` (``ClaimRecord.from_bytes``) holds it."""
        return cls(
            identifier=identifier,
            learner=_shared(record.learner) or UNKNOWN_LEARNER,
            claimed_at=record.claimed_at,
            host=_shared(record.host),
            pid=record.pid,
            worker=record.worker,
            state=_shared(record.state),
            incarnation=_shared(record.incarnation),
        )

    @property
    def stream(self) -> tuple[str, str | None, int | None, Any]:
        """Claims made one after another by one claiming thread or DataLoader worker."""
        return (self.learner, self.host, self.pid, self.worker)


@dataclass(frozen=True)
class UnitSpan:
    """A unit as its learner trained it: its first batch's start to its last batch's end (unix
    seconds), from the ``unit_spans`` of the learner's progress record (recent units only)."""

    unit: str
    first: float
    last: float
    batches: int


@dataclass
class LearnerStatus:
    """One learner's row: its claims counted from ``units/``, the rest from its progress record."""

    learner: str
    units: int = 0
    samples: int | None = None
    samples_in_run: int | None = None
    """Of ``samples``, those whose progress the run's state holds (a Session's learners)."""
    samples_per_s: float | None = None
    steps: int | None = None
    started: float | None = None
    last_seen: float | None = None
    finished: bool | None = None
    done: int | None = None
    """Units this learner owns whose ``done/`` record exists (elastic runs only, else None)."""
    in_progress: int | None = None
    orphaned: int | None = None
    lease: str | None = None
    """``"live"``, ``"expired"`` or ``"stopped"`` (elastic runs with leases), else None."""
    unfinished: int | None = None
    """Units claimed under this learner id and not finished: being trained now, or left by a
    run of it that stopped (its ``work/{learner}/`` records; None: none)."""
    presence: str | None = None
    """Its presence record (``learners/``, written by its Session and its queue) judged as the
    nodes judge it: ``"live"``, ``"expired"`` (not renewed for three of its renewal intervals)
    or ``"stopped"``; None without one."""
    seen_alive: float | None = None
    """When it was last known alive (unix seconds): its presence record's last renewal (when
    this reader saw the record change, where it has; else the writer's own time), or without one
    its progress record's ``last_seen``."""
    may_be_dead: bool | None = None
    """True when it has neither finished nor stopped and ``seen_alive`` is well past its renewal
    interval: its process may have died (nothing else would say so without a lease). None when
    its lease judges it (``lease``) or nothing does."""


@dataclass
class RunStatus:
    """Everything ``status`` shows, as plain data (``to_dict`` gives the ``--json`` output)."""

    mailbox: str
    read_at: float
    created: float | None = None
    units_total: int | None = None
    learners: list[LearnerStatus] = field(default_factory=list)
    claims: list[Claim] = field(default_factory=list)
    done: list[str] = field(default_factory=list)
    """Units with a ``done/`` record (elastic runs; empty for the design note's queue)."""
    released: list[str] = field(default_factory=list)
    orphaned: list[str] = field(default_factory=list)
    """Unfinished units whose owner's lease expired (any node running with leases may take them)."""
    elastic: bool = False
    unreadable: list[Unreadable] = field(default_factory=list)
    """Records skipped because they are unusable (not JSON, too large or deep, bad fields)."""
    unfinished: dict[str, list[str]] = field(default_factory=dict)
    """Learner -> the units claimed under it and not finished (its ``work/`` records): a learner
    that is not running holds them untrained until its id takes them back."""
    unit_spans: dict[str, list[UnitSpan]] = field(default_factory=dict)
    """Learner -> its recent units' training spans, from progress records that carry them
    (written by a ``Session`` beside ``shared_queue``); not part of ``to_dict``."""

    @property
    def units_claimed(self) -> int:
        return len(self.claims)

    @property
    def units_in_progress(self) -> int | None:
        """Claimed units neither done, released nor orphaned (None for the design note's queue)."""
        if not self.elastic:
            return None
        return len(self.claims) - len(self.done) - len(self.released) - len(self.orphaned)

    @property
    def empty(self) -> bool:
        return self.units_total is None and not self.claims and not self.learners and not self.unreadable

    def learner(self, name: str) -> LearnerStatus | None:
        return next((row for row in self.learners if row.learner == name), None)

    def to_dict(self) -> dict[str, Any]:
        """The stable ``--json`` document; keys are only ever added, never renamed."""
        return {
            "mailbox": self.mailbox,
            "read_at": self.read_at,
            "created": self.created,
            "units_total": self.units_total,
            "units_claimed": self.units_claimed,
            "learners": [asdict(row) for row in self.learners],
            "elastic": self.elastic,
            "units_done": len(self.done) if self.elastic else None,
            "units_in_progress": self.units_in_progress,
            "units_released": len(self.released) if self.elastic else None,
            "units_orphaned": len(self.orphaned) if self.elastic else None,
            "orphaned": list(self.orphaned),
            "unfinished": {learner: list(units) for learner, units in self.unfinished.items()},
            "unreadable": [asdict(record) for record in self.unreadable],
        }


def _shared(text: str | None) -> str | None:
    """``text`` interned: the few learner, host and incarnation names repeat in every claim."""
    return None if text is None else sys.intern(text)


def _number(value: Any, kind: type = float) -> Any:
    """``value`` as ``kind`` when it is a real number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return kind(value)


_PLAIN_LEARNER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@:+-]{0,199}")
"""Older or foreign claims may hold just the learner id as text."""


_PREFIXES: tuple[tuple[str, type[Record]], ...] = (
    (CLAIMS_PREFIX, ClaimRecord),
    (LEASES_PREFIX, LeaseRecord),
    (LEARNERS_PREFIX, PresenceRecord),
    (PROGRESS_PREFIX, ProgressRecord),
)


def _record_of(key: str) -> type[Record]:
    """The record kind stored at ``key`` (named in messages)."""
    return next((record for prefix, record in _PREFIXES if key.startswith(prefix)), RunRecord)


def _checked(record: type[RecordT], key: str, data: bytes) -> tuple[RecordT | None, str | None]:
    """``(record, None)``, or ``(None, problem)`` for a record ``gradientmail.records`` refuses."""
    try:
        return record.from_bytes(data, key), None
    except RecordError as exc:
        return None, str(exc)


def _claim(identifier: str, data: bytes) -> tuple[Claim, str | None]:
    """The claim (``learner="?"`` if unusable) and what is wrong with it (None: nothing)."""
    try:
        # ``ClaimRecord.from_bytes`` less its wrapper: the fields are checked (``records.CLAIM``)
        # and read once each, which is a sixth of the cost of a 100k-unit status.
        body = parse_record(ClaimRecord.KIND, data, CLAIMS_PREFIX + identifier)
    except RecordError as exc:
        text = data.decode("utf-8", "replace").strip() if len(data) <= 200 else ""
        if _PLAIN_LEARNER.fullmatch(text):
            return Claim(identifier, text), None
        return Claim(identifier, UNKNOWN_LEARNER), str(exc)
    claimed_at = body.get("claimed_at")
    return Claim(
        identifier,
        _shared(body["learner"]),
        None if claimed_at is None else float(claimed_at),
        _shared(body.get("host")),
        body.get("pid"),
        body.get("worker"),
        _shared(body.get("state")),
        _shared(body.get("incarnation")),
    ), None


def parse_claim(identifier: str, data: bytes | None) -> Claim | None:
    """A ``Claim`` from a claim body; None when the key vanished, ``learner="?"`` if unusable."""
    return None if data is None else _claim(identifier, data)[0]


def parse_progress(learner: str, data: bytes | None) -> LearnerStatus | None:
    """A learner's row from its progress record; None when missing or unusable."""
    if data is None:
        return None
    return _progress(learner, data)[0]


def _spans(body: ProgressRecord) -> list[UnitSpan]:
    """The ``unit_spans`` of a progress record already checked by ``gradientmail.records``."""
    spans = body.get("unit_spans") or {}
    return [
        UnitSpan(entry["unit"], float(entry["first"]), float(entry["last"]), entry["batches"])
        for entry in spans.get("recent", ())
    ]


def _progress(learner: str, data: bytes) -> tuple[LearnerStatus | None, str | None, list[UnitSpan]]:
    body, problem = _checked(ProgressRecord, f"{PROGRESS_PREFIX}{learner}.json", data)
    if body is None:
        return None, problem, []
    finished = body.get("finished")
    row = LearnerStatus(
        learner=body.get("learner") if isinstance(body.get("learner"), str) else learner,
        samples=_number(body.get("samples"), int),
        samples_in_run=_number(body.get("samples_in_run"), int),
        samples_per_s=_number(body.get("samples_per_s")),
        steps=_number(body.get("steps"), int),
        started=_number(body.get("started")),
        last_seen=_number(body.get("last_seen")),
        # Some writers store a finish timestamp rather than a flag.
        finished=bool(finished) if finished is not None else None,
    )
    if row.samples_per_s is None and row.samples and row.started and row.last_seen:
        elapsed = row.last_seen - row.started
        rate = row.samples / elapsed if elapsed > 0 else math.nan
        row.samples_per_s = rate if math.isfinite(rate) else None
    return row, None, _spans(body)


def default_threads(mailbox: Mailbox) -> int:
    """Parallel GETs worth making on ``mailbox``: ``DEFAULT_THREADS`` for a store across a network,
    1 for a directory or memory (reads there wait on no network: threads only contend for the GIL,
    which made a 100k-unit ``status`` 1.5x as costly)."""
    from gradientmail.mailbox.local import LocalMailbox
    from gradientmail.mailbox.memory import MemoryMailbox

    return 1 if type(mailbox) in (LocalMailbox, MemoryMailbox) else DEFAULT_THREADS


class RunReader:
    """Reads a run repeatedly (``status --watch``), fetching each permanent claim body once."""

    def __init__(
        self,
        mailbox: Mailbox,
        *,
        threads: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] | None = None,
    ) -> None:
        """``threads``: parallel GETs (default ``default_threads(mailbox)``); ``clock`` times how
        long each lease and presence record stood still, ``wall`` is the reader's unix time
        (default ``time.time``; a test passes fake ones)."""
        if threads is None:
            threads = default_threads(mailbox)
        if threads < 1:
            raise ValueError(f"threads must be >= 1, not {threads}")
        self.mailbox = mailbox
        self.threads = threads
        self.wall = wall if wall is not None else lambda: time.time()
        self._claims: dict[str, Claim] = {}
        self._done: set[str] = set()
        self._lease_sightings = Sightings(clock)  # how long each lease stood still, on our clock
        self._presence_sightings = Sightings(clock)  # the same for presence records
        self._presence_first: dict[str, bytes] = {}  # each presence record as first read here
        self._unreadable_claims: dict[str, str] = {}  # claims are read once: their problems kept

    def _get(self, key: str) -> Fetched:
        """The record at ``key``, read with the record bound; refused, it is unreadable."""
        try:
            return Fetched(key, get_record(self.mailbox, key, _record_of(key).KIND))
        except RecordError as exc:
            return Fetched(key, None, str(exc))

    def _fetch(self, keys: Iterable[str]) -> Iterator[Fetched]:
        """Each key's record, ``threads`` GETs at a time, ``FETCH_CHUNK`` keys per batch."""
        keys = list(keys)
        if len(keys) <= 1 or self.threads == 1:
            yield from map(self._get, keys)
            return
        with ThreadPoolExecutor(max_workers=min(self.threads, len(keys))) as pool:
            for start in range(0, len(keys), FETCH_CHUNK):
                yield from pool.map(self._get, keys[start : start + FETCH_CHUNK])

    def read(self) -> RunStatus:
        read_at = self.wall()
        unreadable: dict[str, str] = {}
        _, run_data, unreadable[RUN_KEY] = self._get(RUN_KEY)
        run_body = None
        if run_data is not None:
            run_body, unreadable[RUN_KEY] = _checked(RunRecord, RUN_KEY, run_data)
        run = {} if run_body is None else run_body.to_dict()

        listed = [key[len(CLAIMS_PREFIX) :] for key in self.mailbox.list(CLAIMS_PREFIX)]
        self._done.update(key[len(DONE_PREFIX) :] for key in self.mailbox.list(DONE_PREFIX))
        lease_keys = [key for key in self.mailbox.list(LEASES_PREFIX) if key.endswith(".json")]
        elastic = bool(self._done or lease_keys or any(claim.state is not None for claim in self._claims.values()))
        # The design note's claims are permanent; elastic claims change hands until their unit is done.
        new = [
            CLAIMS_PREFIX + identifier
            for identifier in listed
            if identifier not in self._claims
            or (self._claims[identifier].state is not None and identifier not in self._done)
        ]
        unfinished: dict[str, list[str]] = {}
        for key in self.mailbox.list(WORK_PREFIX):  # the key names learner and unit: no GET
            learner, _, identifier = key[len(WORK_PREFIX) :].partition("/")
            if learner and identifier:
                unfinished.setdefault(learner, []).append(identifier)
        progress_keys = [key for key in self.mailbox.list(PROGRESS_PREFIX) if key.endswith(".json")]
        presence_keys = [key for key in self.mailbox.list(LEARNERS_PREFIX) if key.endswith(".json")]
        fetched = self._fetch([*new, *progress_keys, *lease_keys, *presence_keys])

        learners: dict[str, LearnerStatus] = {}
        unit_spans: dict[str, list[UnitSpan]] = {}
        leases: dict[str, bytes | None] = {}
        presences: dict[str, bytes] = {}
        for key, data, refused in fetched:
            if key.startswith(CLAIMS_PREFIX):
                identifier = key[len(CLAIMS_PREFIX) :]
                if data is not None or refused is not None:
                    unknown = Claim(identifier, UNKNOWN_LEARNER)  # refused unread
                    claim, problem = _claim(identifier, data) if data is not None else (unknown, refused)
                    self._claims[identifier] = claim
                    self._unreadable_claims.pop(key, None)
                    if problem is not None:
                        self._unreadable_claims[key] = problem
            elif key.startswith(LEASES_PREFIX):
                leases[key[len(LEASES_PREFIX) : -len(".json")]] = data  # refused: judged as missing
                unreadable[key] = refused if data is None else _checked(LeaseRecord, key, data)[1]
            elif key.startswith(LEARNERS_PREFIX):
                if data is not None:
                    presences[key[len(LEARNERS_PREFIX) : -len(".json")]] = data
                else:
                    unreadable[key] = refused
            elif data is not None:
                name = key[len(PROGRESS_PREFIX) : -len(".json")]
                row, unreadable[key], spans = _progress(name, data)
                if row is not None:
                    learners[row.learner] = row
                    if spans:
                        unit_spans[row.learner] = spans
            else:
                unreadable[key] = refused
        elastic = elastic or any(claim.state is not None for claim in self._claims.values())
        lease_state = {name: self._lease_state(name, data, read_at) for name, data in leases.items()}

        claims = sorted(self._claims.values(), key=lambda c: (c.claimed_at or 0.0, c.identifier))
        done, released, orphaned = [], [], []
        for claim in claims:
            row = learners.get(claim.learner)
            if row is None:
                row = learners[claim.learner] = LearnerStatus(claim.learner)
            if elastic and row.done is None:
                row.done = row.in_progress = row.orphaned = 0
            row.units += 1
            if not elastic:
                continue
            if claim.identifier in self._done:
                done.append(claim.identifier)
                row.done += 1
            elif claim.state == "released":
                released.append(claim.identifier)
            elif claim.state is not None and lease_state.get(claim.learner) in ("expired", "stopped"):
                orphaned.append(claim.identifier)
                row.orphaned += 1
            else:
                row.in_progress += 1
        for name, state in lease_state.items():
            learners.setdefault(name, LearnerStatus(name)).lease = state
        for name, units in unfinished.items():
            learners.setdefault(name, LearnerStatus(name)).unfinished = len(units)
        for name, data in presences.items():
            key = f"{LEARNERS_PREFIX}{name}.json"
            record, unreadable[key] = _checked(PresenceRecord, key, data)
            row = learners.get(name)  # a learner is listed by its claims, progress or lease
            if record is not None and row is not None:
                row.presence, row.seen_alive = self._presence_state(name, record, data, read_at)
        for row in learners.values():
            row.may_be_dead = _may_be_dead(row, read_at)

        return RunStatus(
            mailbox=describe(self.mailbox),
            read_at=read_at,
            created=_number(run.get("created")),
            units_total=_number(run.get("units"), int),
            learners=[learners[name] for name in sorted(learners)],
            claims=claims,
            done=sorted(done),
            released=sorted(released),
            orphaned=sorted(orphaned),
            elastic=elastic,
            unreadable=[
                Unreadable(key, problem)
                for key, problem in sorted({**self._unreadable_claims, **unreadable}.items())
                if problem is not None
            ],
            unfinished={name: sorted(units) for name, units in sorted(unfinished.items())},
            unit_spans=unit_spans,
        )

    def _lease_state(self, learner: str, data: bytes | None, now: float) -> str | None:
        """``live``, ``expired`` or ``stopped`` for one ``leases/{learner}.json`` record."""
        if data is None:
            return None
        body = _checked(LeaseRecord, LEASES_PREFIX + learner + ".json", data)[0]
        if body is None:
            return None
        lease_s = _number(body.get("lease_s"))
        if lease_s is None:  # no time to judge by: only a stop shows
            return STOPPED if judge_lease(body, math.inf) == STOPPED else None
        # The writer's clock against ours (fine for a display), then the record standing still.
        return judge_lease(body, lease_s, now=now, unchanged_s=lambda: self._lease_sightings.unchanged_s(learner, data))

    def _presence_state(
        self, learner: str, record: PresenceRecord, data: bytes, now: float
    ) -> tuple[str, float | None]:
        """The verdict on ``learners/{learner}.json`` and when its writer was last known alive.

        As a node on another machine judges it (``judge_lease``): expired once it has not
        changed for three of its renewal intervals, on this reader's clock where it has seen the
        record change (``--watch``), else by its writer's clock, allowing ``CLOCK_TOLERANCE_S``
        of skew.
        """
        window = presence_window_s(record)
        held = self._presence_sightings.unchanged_s(learner, data)
        watched = self._presence_first.setdefault(learner, data) != data  # it changed while read here
        state = judge_lease(
            record,
            window,
            now=None if watched else now,
            stale_s=window + CLOCK_TOLERANCE_S,
            unchanged_s=lambda: held,
        )
        return state, now - held if watched else record.time


def _may_be_dead(row: LearnerStatus, now: float) -> bool | None:
    """``LearnerStatus.may_be_dead`` from the rest of the row (``seen_alive`` filled in for a
    learner known by its progress record alone)."""
    if row.lease is not None:
        return None  # its lease says whether it lives
    if row.finished or row.presence == STOPPED:
        return False
    if row.presence is not None:
        return row.presence == EXPIRED
    if row.finished is False and row.last_seen is not None:
        row.seen_alive = row.last_seen
        return now - row.last_seen > SILENT_PROGRESS_S + CLOCK_TOLERANCE_S
    return None


def read_run(mailbox: Mailbox, *, threads: int | None = None) -> RunStatus:
    """Read the run in ``mailbox`` once: one listing per prefix, one GET per record.

    Args:
        mailbox: Any mailbox holding the run.
        threads: Parallel GETs for the claim bodies (default ``default_threads(mailbox)``).

    Returns:
        The run as plain data (``RunStatus.empty`` when the mailbox holds none).

    Example:
        >>> from gradientmail import MemoryMailbox
        >>> box = MemoryMailbox("doctest-read-run")
        >>> box.put_if_absent("units/000000-0.json", b'{"learner": "node-A", "claimed_at": 1.0}')
        True
        >>> run = read_run(box)
        >>> run.units_claimed, [row.learner for row in run.learners]
        (1, ['node-A'])
    """
    return RunReader(mailbox, threads=threads).read()


def require_run(status: RunStatus) -> RunStatus:
    """``status`` itself, or ``RunNotFoundError`` when the mailbox holds no run at all."""
    if status.empty:
        raise RunNotFoundError(
            f"no run in {status.mailbox}: no {RUN_KEY}, no claims under {CLAIMS_PREFIX} and no "
            f"records under {PROGRESS_PREFIX} (is this the run's mailbox URL and prefix?)"
        )
    return status
