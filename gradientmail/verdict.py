"""Whether a record's writer is alive: the one liveness verdict, for leases and presence records.

A lease (``leases/``) and a presence record (``learners/``) both say "my writer runs" by being
rewritten. ``judge_lease`` decides from what the caller knows: the record's own state, the
writer's clock (``now``) and how long the caller has seen it unchanged on its own clock
(``Sightings``). The elastic queue (``queue.liveness.LeaseWatch``), takeovers, ``presence.Presence``
(one live incarnation per learner id) and ``gradientmail status`` all ask it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

from gradientmail.records import FENCED, STOPPED, LeaseRecord, PresenceRecord

__all__ = ["CLOCK_TOLERANCE_S", "EXPIRED", "LIVE", "Sightings", "judge_lease"]

LIVE, EXPIRED = "live", "expired"
"""What ``judge_lease`` says of a writer, besides ``records.STOPPED`` (it said it stopped)."""

CLOCK_TOLERANCE_S = 30.0
"""Clock skew tolerated where a writer's own time is compared with the reader's: a presence
record long dead, a lease read for the first time (``LeaseWatch.vouches``), a learner that
``gradientmail status`` shows as possibly dead."""


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
    record: LeaseRecord | PresenceRecord | None,
    lease_s: float,
    *,
    unchanged_s: Callable[[], float] | None = None,
    incarnation: str | None = None,
    now: float | None = None,
    stale_s: float | None = None,
) -> str:
    """``LIVE``, ``EXPIRED`` or ``STOPPED`` for a (checked) lease or presence record.

    A record that says its writer stopped is ``STOPPED``; a lease a peer fenced (it judged the
    writer dead and takes its units over, ``queue.lease``) or one naming another incarnation
    than ``incarnation`` (the writer restarted) is ``EXPIRED``; with ``now`` (unix seconds) so is one
    whose writer's ``time`` is more than ``stale_s`` (default ``lease_s``) ago; with
    ``unchanged_s`` (asked only if the rest leaves it live) so is one that stood unchanged for
    ``lease_s`` on the caller's clock. A missing or unusable record (None) is judged by
    ``unchanged_s`` alone.

    Example:
        >>> lease = LeaseRecord({"state": "running", "time": 100.0})
        >>> judge_lease(lease, 5.0, now=106.0)
        'expired'
        >>> judge_lease(lease, 5.0, now=104.0, unchanged_s=lambda: 1.0)
        'live'
        >>> judge_lease(lease.replace(state="fenced", fenced_by="node-1"), 5.0, unchanged_s=lambda: 0.0)
        'expired'
    """
    if record is not None:
        if record.state == STOPPED:
            return STOPPED
        if record.state == FENCED:
            return EXPIRED
        if incarnation is not None and record.incarnation != incarnation:
            return EXPIRED
        written = record.time
        if now is not None and written is not None and now - written > (lease_s if stale_s is None else stale_s):
            return EXPIRED
    if unchanged_s is not None and unchanged_s() >= lease_s:
        return EXPIRED
    return LIVE
