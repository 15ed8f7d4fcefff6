"""The claim record, typed, and the one judgement of a claim owner's lease.

A claim (``units/{identifier}``, fields in ``gradientmail.layout``) is read in one place,
``ClaimRecord.from_bytes`` (bounded and checked by ``gradientmail.records``), and written by
``to_bytes``, which gives back exactly the body it holds: unknown fields and the key order are
kept, so a rewrite (a release) changes only what it means to change. ``judge_lease`` decides
whether a lease record's writer is live, expired or stopped; the queue (``LeaseWatch``) and the
status tool (``RunReader``) both ask it, each with what it knows.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from gradientmail.records import CLAIM
from gradientmail.records import parse as parse_record

__all__ = ["EXPIRED", "LIVE", "STOPPED", "ClaimRecord", "Sightings", "judge_lease"]

_ENCODER = json.JSONEncoder(separators=(",", ":"))
"""``json.dumps(..., separators=(",", ":"))``'s encoder, built once instead of per claim."""

LIVE, EXPIRED, STOPPED = "live", "expired", "stopped"
"""What ``judge_lease`` says of a lease (``STOPPED`` is also the lease record's ``state``)."""


def _typed(value: Any, kind: type | tuple[type, ...]) -> Any:
    """``value`` if it is a ``kind`` (never a bool standing in for a number), else None."""
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        return None
    return value if isinstance(value, kind) else None


@dataclass(frozen=True, eq=False)
class ClaimRecord:
    """One claim body: typed fields over the exact JSON object it was read from or built as.

    Example:
        >>> record = ClaimRecord.from_bytes(b'{"learner":"node-0","token":"t0","worker":null}')
        >>> record.learner, record.token, record.state
        ('node-0', 't0', None)
        >>> record.to_bytes()
        b'{"learner":"node-0","token":"t0","worker":null}'
    """

    fields: Mapping[str, Any]
    """The body, key order kept (read-only); unknown fields are kept and ignored."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "fields", MappingProxyType(dict(self.fields)))

    @classmethod
    def from_bytes(cls, data: bytes, key: str = "") -> ClaimRecord:
        """The claim in ``data``, bounded and checked.

        Raises:
            RecordError: not a usable claim (too large or deep, not JSON, a bad field).
        """
        return cls(parse_record(CLAIM, data, key))

    @classmethod
    def of(cls, claim: Mapping[str, Any] | ClaimRecord) -> ClaimRecord:
        """``claim`` itself, or a claim dict (as the queue's callbacks see it) wrapped."""
        return claim if isinstance(claim, ClaimRecord) else cls(claim)

    def to_bytes(self) -> bytes:
        """The body as compact JSON: the bytes a claim is stored as."""
        return _ENCODER.encode(dict(self.fields)).encode()

    def to_dict(self) -> dict[str, Any]:
        """A mutable copy of the body (the dict ``queue.claims.parse_claim`` returns)."""
        return dict(self.fields)

    def replace(self, **changes: Any) -> ClaimRecord:
        """A copy with ``changes``: fields already present keep their place, new ones go last."""
        return ClaimRecord({**self.fields, **changes})

    @property
    def learner(self) -> str | None:
        return _typed(self.fields.get("learner"), str)

    @property
    def token(self) -> str | None:
        return _typed(self.fields.get("token"), str)

    @property
    def host(self) -> str | None:
        return _typed(self.fields.get("host"), str)

    @property
    def pid(self) -> int | None:
        return _typed(self.fields.get("pid"), int)

    @property
    def worker(self) -> Any:
        """The DataLoader worker that claimed (None: the main process), as stored."""
        return self.fields.get("worker")

    @property
    def claimed_at(self) -> float | None:
        value = _typed(self.fields.get("claimed_at"), (int, float))
        return None if value is None else float(value)

    @property
    def state(self) -> str | None:
        """``"active"`` or ``"released"`` for elastic claims, None for the seed's."""
        return _typed(self.fields.get("state"), str)

    @property
    def incarnation(self) -> str | None:
        return _typed(self.fields.get("incarnation"), str)

    @property
    def step(self) -> int | None:
        return _typed(self.fields.get("step"), int)

    @property
    def position(self) -> int | None:
        value = _typed(self.fields.get("position"), int)
        return value if value is not None and value >= 0 else None

    @property
    def taken_from(self) -> str | None:
        return _typed(self.fields.get("taken_from"), str)


class Sightings:
    """How long each watched record has stood unchanged, on the watcher's own clock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._seen: dict[Hashable, tuple[bytes | None, float]] = {}

    def unchanged_s(self, name: Hashable, data: bytes | None) -> float:
        """Seconds ``name`` has held ``data`` since first seen so (0.0: new or changed now)."""
        now = self.clock()
        seen = self._seen.get(name)
        if seen is None or seen[0] != data:
            self._seen[name] = (data, now)
            return 0.0
        return now - seen[1]


def judge_lease(
    lease: Mapping[str, Any] | None,
    lease_s: float,
    *,
    unchanged_s: Callable[[], float] | None = None,
    incarnation: str | None = None,
    now: float | None = None,
) -> str:
    """``LIVE``, ``EXPIRED`` or ``STOPPED`` for a (checked) lease record, from what the caller knows.

    A record that says its node stopped is ``STOPPED``; one naming another incarnation than
    ``incarnation`` (the node restarted) is ``EXPIRED``; with ``now`` (unix seconds) so is one
    whose writer's ``time`` is more than ``lease_s`` ago; with ``unchanged_s`` (asked only if
    the rest leaves it live) so is one that stood unchanged for ``lease_s`` on the caller's clock.
    A missing or unusable record (None) is judged by ``unchanged_s`` alone.

    Example:
        >>> judge_lease({"state": "running", "time": 100.0}, 5.0, now=106.0)
        'expired'
        >>> judge_lease({"state": "running", "time": 100.0}, 5.0, now=104.0, unchanged_s=lambda: 1.0)
        'live'
    """
    if lease is not None:
        if lease.get("state") == STOPPED:
            return STOPPED
        if incarnation is not None and lease.get("incarnation") != incarnation:
            return EXPIRED
        written = _typed(lease.get("time"), (int, float))
        if now is not None and written is not None and now - float(written) > lease_s:
            return EXPIRED
    if unchanged_s is not None and unchanged_s() >= lease_s:
        return EXPIRED
    return LIVE
