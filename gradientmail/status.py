"""Read a run from its mailbox into plain data: what ``gradientmail status`` and ``plot`` show.

Only the on-store formats of ``gradientmail.layout`` are read (``run.json``, the claim bodies
under ``units/`` and the ``progress/{learner}.json`` records), so this works on any mailbox,
from any machine, while the run is going on or long after it ended. Nothing is written.

Cost: one listing of ``units/`` and ``progress/``, one GET per progress record, and one GET per
claim body (claims are permanent, so a ``RunReader`` fetches each body once and only new claims
on later reads). For 800 units on S3 that is about 800 GETs the first time, issued by a thread
pool (``threads``, 16 by default).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from gradientmail.errors import GradientMailError
from gradientmail.layout import CLAIMS_PREFIX, PROGRESS_PREFIX, RUN_KEY
from gradientmail.mailbox.base import Mailbox, describe

DEFAULT_THREADS = 16
"""Parallel GETs when reading claim bodies; object stores answer each in tens of ms."""

UNKNOWN_LEARNER = "?"
"""Learner name shown for a claim whose body cannot be parsed."""


class RunNotFoundError(GradientMailError, LookupError):
    """The mailbox exists but holds no run (no ``run.json``, claims or progress records)."""


@dataclass(frozen=True)
class Claim:
    """One ``units/{identifier}`` claim body (fields missing from the body are None)."""

    identifier: str
    learner: str
    claimed_at: float | None = None
    host: str | None = None
    pid: int | None = None
    worker: Any = None

    @property
    def stream(self) -> tuple[str, str | None, int | None, Any]:
        """Claims made one after another by one claiming thread or DataLoader worker."""
        return (self.learner, self.host, self.pid, self.worker)


@dataclass
class LearnerStatus:
    """One learner's row: its claims counted from ``units/``, the rest from its progress record."""

    learner: str
    units: int = 0
    samples: int | None = None
    samples_per_s: float | None = None
    steps: int | None = None
    started: float | None = None
    last_seen: float | None = None
    finished: bool | None = None


@dataclass
class RunStatus:
    """Everything ``status`` shows, as plain data (``to_dict`` gives the ``--json`` output)."""

    mailbox: str
    read_at: float
    created: float | None = None
    units_total: int | None = None
    learners: list[LearnerStatus] = field(default_factory=list)
    claims: list[Claim] = field(default_factory=list)

    @property
    def units_claimed(self) -> int:
        return len(self.claims)

    @property
    def empty(self) -> bool:
        return self.units_total is None and not self.claims and not self.learners

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
        }


def _json_object(data: bytes | None) -> dict[str, Any] | None:
    if data is None:
        return None
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def _number(value: Any, kind: type = float) -> Any:
    """``value`` as ``kind`` when it is a real number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return kind(value)


def parse_claim(identifier: str, data: bytes | None) -> Claim | None:
    """A ``Claim`` from a claim body; None when the key vanished, ``learner="?"`` if unreadable."""
    if data is None:
        return None
    body = _json_object(data)
    if body is None:
        # Older or foreign claims may hold just the learner id as text.
        text = data.decode("utf-8", "replace").strip()
        learner = text if text and len(text) <= 200 and "\n" not in text else UNKNOWN_LEARNER
        return Claim(identifier, learner)
    learner = body.get("learner")
    return Claim(
        identifier=identifier,
        learner=learner if isinstance(learner, str) and learner else UNKNOWN_LEARNER,
        claimed_at=_number(body.get("claimed_at")),
        host=body.get("host") if isinstance(body.get("host"), str) else None,
        pid=_number(body.get("pid"), int),
        worker=body.get("worker"),
    )


def parse_progress(learner: str, data: bytes | None) -> LearnerStatus | None:
    body = _json_object(data)
    if body is None:
        return None
    finished = body.get("finished")
    row = LearnerStatus(
        learner=body.get("learner") if isinstance(body.get("learner"), str) else learner,
        samples=_number(body.get("samples"), int),
        samples_per_s=_number(body.get("samples_per_s")),
        steps=_number(body.get("steps"), int),
        started=_number(body.get("started")),
        last_seen=_number(body.get("last_seen")),
        # Some writers store a finish timestamp rather than a flag.
        finished=bool(finished) if finished is not None else None,
    )
    if row.samples_per_s is None and row.samples and row.started and row.last_seen:
        elapsed = row.last_seen - row.started
        if elapsed > 0:
            row.samples_per_s = row.samples / elapsed
    return row


class RunReader:
    """Reads a run repeatedly (``status --watch``), fetching each permanent claim body once."""

    def __init__(self, mailbox: Mailbox, *, threads: int = DEFAULT_THREADS) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, not {threads}")
        self.mailbox = mailbox
        self.threads = threads
        self._claims: dict[str, Claim] = {}

    def _get_all(self, keys: Iterable[str]) -> list[tuple[str, bytes | None]]:
        keys = list(keys)
        if len(keys) <= 1 or self.threads == 1:
            return [(key, self.mailbox.get(key)) for key in keys]
        with ThreadPoolExecutor(max_workers=min(self.threads, len(keys))) as pool:
            return list(zip(keys, pool.map(self.mailbox.get, keys), strict=True))

    def read(self) -> RunStatus:
        read_at = time.time()
        run = _json_object(self.mailbox.get(RUN_KEY)) or {}

        new = [key for key in self.mailbox.list(CLAIMS_PREFIX)
               if key[len(CLAIMS_PREFIX):] not in self._claims]
        progress_keys = [key for key in self.mailbox.list(PROGRESS_PREFIX) if key.endswith(".json")]
        fetched = self._get_all([*new, *progress_keys])

        learners: dict[str, LearnerStatus] = {}
        for key, data in fetched:
            if key.startswith(CLAIMS_PREFIX):
                identifier = key[len(CLAIMS_PREFIX):]
                claim = parse_claim(identifier, data)
                if claim is not None:
                    self._claims[identifier] = claim
            else:
                name = key[len(PROGRESS_PREFIX):-len(".json")]
                row = parse_progress(name, data)
                if row is not None:
                    learners[row.learner] = row

        claims = sorted(self._claims.values(), key=lambda c: (c.claimed_at or 0.0, c.identifier))
        for claim in claims:
            learners.setdefault(claim.learner, LearnerStatus(claim.learner)).units += 1

        return RunStatus(
            mailbox=describe(self.mailbox),
            read_at=read_at,
            created=_number(run.get("created")),
            units_total=_number(run.get("units"), int),
            learners=[learners[name] for name in sorted(learners)],
            claims=claims,
        )


def read_run(mailbox: Mailbox, *, threads: int = DEFAULT_THREADS) -> RunStatus:
    """Read the run in ``mailbox`` once (see the module docstring for the cost)."""
    return RunReader(mailbox, threads=threads).read()


def require_run(status: RunStatus) -> RunStatus:
    """``status`` itself, or ``RunNotFoundError`` when the mailbox holds no run at all."""
    if status.empty:
        raise RunNotFoundError(
            f"no run in {status.mailbox}: no {RUN_KEY}, no claims under {CLAIMS_PREFIX} and no "
            f"records under {PROGRESS_PREFIX} (is this the run's mailbox URL and prefix?)"
        )
    return status
