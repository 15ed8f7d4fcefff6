"""Old path of ``gradientmail.queue.units``, kept as a thin re-export."""

from __future__ import annotations

from gradientmail.queue.units import DEFAULT_BLOCK, DEFAULT_LAG, Unit, rotated_order, unit_grid

__all__ = ["DEFAULT_BLOCK", "DEFAULT_LAG", "Unit", "rotated_order", "unit_grid"]
