"""Old path of ``gradientmail.queue.progress_display``, kept as a thin re-export."""

from __future__ import annotations

from gradientmail.queue.progress_display import (
    LIST_EVERY_S,
    PLAIN_EVERY_S,
    RATE_WINDOW_S,
    REFRESH_S,
    ProgressDisplay,
    log,
)

__all__ = ["LIST_EVERY_S", "PLAIN_EVERY_S", "ProgressDisplay", "RATE_WINDOW_S", "REFRESH_S", "log"]
