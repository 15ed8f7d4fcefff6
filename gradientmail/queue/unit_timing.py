"""When the training loop trained each unit: its first batch's start to its last batch's end.

Claims lead training by the prefetch buffer, so a Gantt chart needs the loop's own timing:
``BatchWatch`` notes when the loop takes a batch and asks for the next; the recent spans travel
in the ``Session``'s progress record (``spans_record``), the last ``KEEP_UNITS`` one by one and
older ones summed, for ``gradientmail plot``. Details: docs/queue.md.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gradientmail.meeting_point import MeetingPoint

__all__ = [
    "BatchWatch",
    "KEEP_UNITS",
    "spans_record",
    "unit_times",
    "UnitTimes",
]


KEEP_UNITS = 64
"""Units whose span a progress record carries one by one (the most recent ones)."""

MAX_SPANS_BYTES = 16 * 1024
"""Most bytes the spans may take in a progress record (records are bounded to 64 KiB)."""


@dataclass
class _Span:
    first: float
    last: float
    batches: int


class UnitTimes:
    """One learner's unit spans in this process; thread-safe (the loop adds, a Session reads)."""

    def __init__(self, keep: int = KEEP_UNITS) -> None:
        self.keep = keep
        self._recent: OrderedDict[str, _Span] = OrderedDict()  # by first batch
        self._older = {"units": 0, "batches": 0, "busy_s": 0.0}
        self._lock = threading.Lock()

    def add(self, identifier: str, start: float, end: float) -> None:
        """One batch of ``identifier`` was trained from ``start`` to ``end`` (unix seconds)."""
        with self._lock:
            span = self._recent.get(identifier)
            if span is None:
                self._recent[identifier] = _Span(start, end, 1)
                while len(self._recent) > self.keep:
                    self._retire(self._recent.popitem(last=False)[1])
                return
            span.first = min(span.first, start)
            span.last = max(span.last, end)
            span.batches += 1

    def _retire(self, span: _Span) -> None:
        self._older["units"] += 1
        self._older["batches"] += span.batches
        self._older["busy_s"] += max(0.0, span.last - span.first)

    @property
    def units(self) -> int:
        """Units with at least one batch trained."""
        with self._lock:
            return len(self._recent) + int(self._older["units"])

    def record(self) -> dict[str, Any] | None:
        """The ``unit_spans`` field of a progress record; None before any batch.

        ``{"recent": [{"unit", "first", "last", "batches"}, ...], "older": {"units",
        "batches", "busy_s"}}``, ``recent`` oldest first, at most ``MAX_SPANS_BYTES`` of JSON
        (units beyond that are counted in ``older``).
        """
        with self._lock:
            recent = list(self._recent.items())
            older = dict(self._older)
        if not recent and not older["units"]:
            return None
        kept: list[dict[str, Any]] = []
        size = 0
        for identifier, span in reversed(recent):
            entry = {"unit": identifier, "first": span.first, "last": span.last, "batches": span.batches}
            size += len(json.dumps(entry)) + 2
            if size > MAX_SPANS_BYTES:
                older["units"] += 1
                older["batches"] += span.batches
                older["busy_s"] += max(0.0, span.last - span.first)
                continue
            kept.append(entry)
        kept.reverse()
        return {"recent": kept, "older": older}


_TIMES: dict[MeetingPoint, UnitTimes] = {}
_TIMES_LOCK = threading.Lock()


def unit_times(point: MeetingPoint) -> UnitTimes:
    """The spans timed in this process by the learner of ``point`` on its store: created on
    first use, shared by its queues; another run (store) starts afresh."""
    with _TIMES_LOCK:
        times = _TIMES.get(point)
        if times is None:
            times = _TIMES[point] = UnitTimes()
        return times


def spans_record(point: MeetingPoint) -> dict[str, Any] | None:
    """The ``unit_spans`` field of the progress record of ``point``'s learner on its store; None
    when this process timed nothing there."""
    with _TIMES_LOCK:
        times = _TIMES.get(point)
    return None if times is None else times.record()


class BatchWatch:
    """Times the batches one training loop takes; counts them for the progress display.

    ``taken(identifier)`` when the loop receives a batch, ``ended()`` when it asks for the
    next one or leaves the block. Both are a clock read and a dict update: they run on the
    training thread and never raise.
    """

    def __init__(self, times: UnitTimes, clock: Callable[[], float] = time.time) -> None:
        self.times = times
        self.clock = clock
        self.batches = 0
        self._units: set[str] = set()
        self._open: tuple[str, float] | None = None

    @property
    def units(self) -> int:
        """Distinct units this loop took batches of."""
        return len(self._units)

    def taken(self, identifier: str | None) -> None:
        self.batches += 1
        if identifier is not None:
            self._units.add(identifier)
            self._open = (identifier, self.clock())

    def ended(self) -> None:
        open_, self._open = self._open, None
        if open_ is not None:
            try:
                self.times.add(open_[0], open_[1], self.clock())
            except Exception:  # a display aid must never break the training loop
                pass
