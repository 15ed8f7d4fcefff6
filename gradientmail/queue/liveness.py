"""The elastic queue's lease expiry, judged on this process's own clock.

Both sides use it: ``queue.reclaim`` (which unit to load, takeovers) and ``queue.progress``
(what the training loop consumed, heartbeats). The records themselves (``LeaseRecord``,
``WorkRecord``) are in ``gradientmail.records``, the verdict in ``gradientmail.verdict``; who
runs a learner id (its presence record) in ``gradientmail.presence``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

from gradientmail.records import LeaseRecord
from gradientmail.verdict import CLOCK_TOLERANCE_S, LIVE, Sightings, judge_lease

__all__ = ["LeaseWatch", "POLL_S", "lease_seconds"]


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


class LeaseWatch:
    """Judges peers' leases on this process's own monotonic clock (``judge_lease``).

    A lease is expired when its record has not changed for ``lease_s`` since this watch first
    saw that exact content, whatever the writer's clock says; a missing record counts as a
    record that never changes. A record that says the node stopped, that a peer fenced
    (``queue.lease``), or that names another incarnation than the claim's (the node restarted),
    is expired at once. ``clock`` is monotonic; ``wall`` (Unix time) only serves ``vouches``.
    """

    def __init__(
        self, lease_s: float, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time
    ) -> None:
        self.lease_s = lease_s
        self.clock = clock
        self.wall = wall
        self._sightings = Sightings(clock)
        self._first_read: dict[str, bytes | None] = {}  # each learner's record as this watch first read it

    def expired(self, learner: str, record: bytes | None, incarnation: str | None = None) -> bool:
        self._first_read.setdefault(learner, record)
        lease = LeaseRecord.read(record)  # unusable: judged like a record that never changes
        state = judge_lease(
            lease,
            self.lease_s,
            unchanged_s=lambda: self._sightings.unchanged_s(learner, record),
            incarnation=incarnation,
        )
        return state != LIVE

    def vouches(self, learner: str, record: bytes | None) -> bool:
        """Whether ``learner``'s lease, not ``expired``, shows its writer alive now.

        On this clock a lease stays live until it stood still a whole lease, so a record first
        read a moment ago reads live even if its writer died long before this process started.
        Until this watch has seen ``learner``'s record change, the record must therefore also
        be recent by its writer's own clock: written less than a lease (plus
        ``CLOCK_TOLERANCE_S`` of clock skew) ago. A missing or unusable record vouches for nobody.
        """
        if record is not None and learner in self._first_read and self._first_read[learner] != record:
            return True  # renewed while this watch looked: alive on this clock
        lease = LeaseRecord.read(record)
        stale_s = self.lease_s + CLOCK_TOLERANCE_S
        return lease is not None and judge_lease(lease, self.lease_s, now=self.wall(), stale_s=stale_s) == LIVE
