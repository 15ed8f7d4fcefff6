"""The elastic queue's shared vocabulary: claim states, work and lease bodies, lease expiry.

Both sides use it: ``queue.reclaim`` (which unit to load, takeovers) and ``queue.progress``
(what the training loop consumed, heartbeats). Record formats: ``gradientmail.layout``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from gradientmail.claim_record import LIVE, Sightings, judge_lease
from gradientmail.errors import RecordError
from gradientmail.records import LEASE, RecordKind
from gradientmail.records import parse as parse_record

__all__ = [
    "ACTIVE",
    "POLL_S",
    "RELEASED",
    "RUNNING",
    "LeaseWatch",
    "dumps",
    "lease_body",
    "lease_seconds",
    "position_value",
    "read_record",
    "step_value",
    "work_body",
]

ACTIVE, RELEASED = "active", "released"
"""A claim's ``state``: being worked on, or handed back for anyone to take."""
RUNNING = "running"
"""A lease's ``state`` while its node runs (``STOPPED`` once it stopped)."""

POLL_S = 0.05
"""Granularity of waits that must notice a stop request."""


def lease_seconds(lease: timedelta | float | None) -> float | None:
    """``lease`` in seconds (None: no leases).

    Raises:
        TypeError: not a ``timedelta`` or a number.
        ValueError: not positive.

    Example:
        >>> lease_seconds(timedelta(minutes=1))
        60.0
    """
    if lease is None:
        return None
    if isinstance(lease, bool) or not isinstance(lease, (timedelta, int, float)):
        raise TypeError(f"lease must be a datetime.timedelta (or seconds), not {type(lease).__name__}")
    seconds = lease.total_seconds() if isinstance(lease, timedelta) else float(lease)
    if not seconds > 0:
        raise ValueError(f"lease must be positive, not {lease!r}")
    return seconds


def dumps(body: Mapping[str, Any]) -> bytes:
    """A record's compact JSON bytes."""
    return json.dumps(body, separators=(",", ":")).encode()


def read_record(kind: RecordKind, data: bytes | None) -> dict[str, Any] | None:
    """A bounded, validated record (``gradientmail.records``), or None: missing or unusable."""
    if data is None:
        return None
    try:
        return parse_record(kind, data)
    except RecordError:
        return None


def step_value(value: Any) -> int | None:
    """``value`` if it is an int step label (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def position_value(value: Any) -> int | None:
    """``value`` if it is a batch position (an int >= 0), else None."""
    step = step_value(value)
    return step if step is not None and step >= 0 else None


def work_body(
    learner_id: str, token: str, incarnation: str, step: int | None, done: bool = False, position: int | None = None
) -> bytes:
    """The body of ``work/{learner}/{identifier}``: the last batch consumed under a claim."""
    return dumps(
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


class LeaseWatch:
    """Judges peers' leases on this process's own monotonic clock (``judge_lease``).

    A lease is expired when its record has not changed for ``lease_s`` since this watch first
    saw that exact content, whatever the writer's clock says; a missing record counts as a
    record that never changes. A record that says the node stopped, or that names another
    incarnation than the claim's (the node restarted), is expired at once.
    """

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s = lease_s
        self.clock = clock
        self._sightings = Sightings(clock)

    def expired(self, learner: str, record: bytes | None, incarnation: str | None = None) -> bool:
        body = read_record(LEASE, record)  # unusable: judged like a record that never changes
        state = judge_lease(
            body,
            self.lease_s,
            unchanged_s=lambda: self._sightings.unchanged_s(learner, record),
            incarnation=incarnation,
        )
        return state != LIVE


def lease_body(learner_id: str, incarnation: str, beat: int, consumed: int, lease_s: float, state: str) -> bytes:
    """The body of ``leases/{learner}.json``: one heartbeat."""
    return dumps(
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
