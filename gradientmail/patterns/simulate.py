"""Old path of ``gradientmail.queue.simulate``, kept as a thin re-export (and still runnable)."""

from __future__ import annotations

from gradientmail.queue.simulate import (
    ORDERS,
    SimulationResult,
    fixed_split_makespan,
    main,
    rotated_positions,
    simulate,
)

__all__ = ["ORDERS", "SimulationResult", "fixed_split_makespan", "main", "rotated_positions", "simulate"]

if __name__ == "__main__":
    main()
