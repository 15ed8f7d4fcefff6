"""The elastic queue's old path: now ``gradientmail.queue.reclaim`` (loading side),
``gradientmail.queue.progress`` (consuming side), ``takeover`` and ``leases``; a thin re-export."""

from __future__ import annotations

from gradientmail.queue.leases import (
    ACTIVE,
    POLL_S,
    RELEASED,
    RUNNING,
    STOPPED,
    LeaseWatch,
    lease_body,
    lease_seconds,
    work_body,
)
from gradientmail.queue.progress import BATCH, END, Consumption, ProgressTracker, Tagged, consume_inline, tagged_items
from gradientmail.queue.reclaim import ElasticClaimer, ElasticOptions, check_elastic
from gradientmail.queue.takeover import Assignment, recorded_progress, recorded_step, take_over

__all__ = [
    "ACTIVE",
    "Assignment",
    "BATCH",
    "Consumption",
    "END",
    "ElasticClaimer",
    "ElasticOptions",
    "LeaseWatch",
    "POLL_S",
    "ProgressTracker",
    "RELEASED",
    "RUNNING",
    "STOPPED",
    "Tagged",
    "check_elastic",
    "consume_inline",
    "lease_body",
    "lease_seconds",
    "recorded_progress",
    "recorded_step",
    "tagged_items",
    "take_over",
    "work_body",
]
