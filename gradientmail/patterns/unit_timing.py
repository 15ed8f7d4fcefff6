"""Old path of ``gradientmail.queue.unit_timing``, kept as a thin re-export."""

from __future__ import annotations

from gradientmail.queue.unit_timing import KEEP_UNITS, MAX_SPANS_BYTES, BatchWatch, UnitTimes, spans_record, unit_times

__all__ = ["BatchWatch", "KEEP_UNITS", "MAX_SPANS_BYTES", "UnitTimes", "spans_record", "unit_times"]
