"""When a node may retire old versions of a fragment: ``Retirement``, one per chain and node.

A version is tombstoned ``KEEP`` versions after it (by the writer of that later version), but
only once two things hold, else the retirement is owed and paid at a later fold:

- **old enough**: a newer version has existed for ``MIN_AGE_S`` on this node's clock, so a
  reader far from the store (or reading a large fragment) has that long between its listing
  and its read, however fast the chain moves;
- **proved superseded**: it is older than the newest version this node *downloaded* and found
  usable. A node trusts what it wrote without reading it back; a peer whose uploads arrive cut
  short would otherwise retire the last good version after ``KEEP`` wins in a row.

Example:
    >>> clock = [0.0]
    >>> rules = Retirement(keep=2, min_age_s=10.0, clock=lambda: clock[0])
    >>> rules.downloaded(5); rules.wrote(6)  # version 4 is owed, not yet old enough
    []
    >>> clock[0] = 11.0; rules.wrote(7)  # 6 has existed for 11 s; 5, the newest downloaded, stays
    [4]
    >>> rules.downloaded(7); clock[0] = 22.0; rules.wrote(8)
    [5, 6]
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

MIN_AGE_S = 10.0
"""A version is retired only once a newer one has existed this long (by the retiring node's own
clock); more copies are kept while the chain moves fast (``GRADIENTMAIL_SESSION_RETIRE_AFTER_S``)."""
MAX_OWED = 1024
"""Deferred retirements a node remembers (beyond that the oldest are left to ``RETIRE``)."""


class Retirement:
    """This node's view of which versions of one fragment it may retire now."""

    def __init__(self, keep: int, min_age_s: float, clock: Callable[[], float] | None = None) -> None:
        self.keep = keep
        self.min_age_s = min_age_s
        self._clock = time.monotonic if clock is None else clock  # looked up now: a virtual clock may stand in
        self._good = -1  # the newest version this node downloaded and found usable
        self._aged = -1  # the newest version known to have existed for min_age_s
        self._sightings: deque[tuple[float, int]] = deque()  # (when, newest version known then)
        self._owed: deque[int] = deque()  # versions this node must retire once safe (ascending)

    def sighted(self, version: int) -> None:
        """Version ``version`` exists now: older ones may be retired ``min_age_s`` from now."""
        now = self._clock()
        if not self._sightings or version > self._sightings[-1][1]:
            self._sightings.append((now, version))
        while self._sightings and now - self._sightings[0][0] >= self.min_age_s:
            self._aged = max(self._aged, self._sightings.popleft()[1])

    def downloaded(self, version: int) -> None:
        """This node read ``version`` from the store and found it usable."""
        self._good = max(self._good, version)

    def wrote(self, version: int) -> list[int]:
        """This node created ``version``: the versions to retire now (its own share, ``keep``
        back, and any owed that became safe), oldest first."""
        self.sighted(version)
        if version >= self.keep:
            self._owed.append(version - self.keep)
            while len(self._owed) > MAX_OWED:
                self._owed.popleft()
        return self.due()

    def due(self) -> list[int]:
        """The owed versions that became safe to retire, oldest first (and no longer owed)."""
        safe = min(self._good, self._aged)  # retire below this
        due = []
        while self._owed and self._owed[0] < safe:
            due.append(self._owed.popleft())
        return due

    @property
    def owes(self) -> bool:
        """Whether retirements are still owed (paid at a later fold, or at ``FragmentChain.settle``)."""
        return bool(self._owed)
