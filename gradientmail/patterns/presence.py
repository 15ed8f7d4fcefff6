"""Old path of ``gradientmail.queue.presence``, kept as a thin re-export."""

from __future__ import annotations

from gradientmail.queue.presence import (
    ATTEMPTS,
    CLOCK_TOLERANCE_S,
    MAX_RECORD_BYTES,
    RENEW_S,
    RUNNING,
    STOPPED,
    WINDOW_RENEWALS,
    Presence,
    presence_renew_s,
)

__all__ = [
    "ATTEMPTS",
    "CLOCK_TOLERANCE_S",
    "MAX_RECORD_BYTES",
    "Presence",
    "RENEW_S",
    "RUNNING",
    "STOPPED",
    "WINDOW_RENEWALS",
    "presence_renew_s",
]
