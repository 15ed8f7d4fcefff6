"""What a learner's queue reports to its Session's progress record: units claimed, units' spans."""

from __future__ import annotations

from collections.abc import Callable

from gradientmail.meeting_point import MeetingPoint, QueueFigures
from gradientmail.queue.claim_counter import units_claimed_by
from gradientmail.queue.unit_timing import spans_record

__all__ = ["queue_figures"]


def queue_figures(point: MeetingPoint) -> Callable[[], QueueFigures]:
    """What this process's queues of ``point``'s learner report to its Session
    (``MeetingPoint.report_figures``): units claimed here on its store, workers included, and recent units' spans."""
    return lambda: QueueFigures(units=units_claimed_by(point.learner_id, point.store), unit_spans=spans_record(point))
