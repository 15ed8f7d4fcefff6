"""What a node's preference order costs: requests and conflicts per claim, and how far nodes drift.

Each cell runs ``gradientmail.sim.queue`` with the queue's default listing (``"adaptive"``):
real ``SharedQueueDataset`` claimers of unequal speed (times per unit 1, 2, 2, 4 repeated, each
unit's time jittered by +-20 %, jitter seed 0) on one shared mailbox on a virtual clock, one lane
per learner and one step per group of the design note's grid, start-up included. The orders
(``gradientmail.sim.queue.ORDERS``):

- ``mapping``: every node walks the mapping's order (``order=None``);
- ``plain``: the design note's plain rotation (``rotated_order(..., block=1, lag=0)``);
- ``default``: ``rotated_order``'s defaults (``block=4, lag=1``);
- ``block=8``: longer own stretches (``block=8, lag=1``).

``step spread`` is the largest gap, in groups of steps, between units being processed at the same
moment. Figures, at the largest unit count: ``orders_requests_per_claim_ORDER_LEARNERS``,
``orders_conflicts_per_claim_ORDER_LEARNERS`` and ``orders_step_spread_ORDER_LEARNERS``
(``block=8`` is ``block8`` in their names).

The virtual clock is deterministic: the same code gives the same table. ``--quick``: 2,000 units, in one
process.

Usage: ``python -m benchmarks.orders [--quick] [--jobs N]``; the last line is one JSON object.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from benchmarks._common import default_jobs, emit, parallel_map, parser, table

UNIT_COUNTS, QUICK_UNIT_COUNTS = (20_000, 100_000), (2_000,)
LEARNER_COUNTS = (1, 16, 64)
PATTERN = (1.0, 2.0, 2.0, 4.0)
JITTER = 0.2
HEADERS = ["units", "learners", "order", "requests/claim", "conflicts/claim", "step spread"]


@dataclass(frozen=True)
class Cell:
    units: int
    learners: int
    order: str


@dataclass(frozen=True)
class Outcome:
    cell: Cell
    units: int  # the grid's, rounded up to whole groups
    requests_per_claim: float
    conflicts_per_claim: float
    step_spread: int


def run_cell(cell: Cell) -> Outcome:
    """One simulation (module-level: cells run in worker processes)."""
    from gradientmail.queue.units import unit_grid
    from gradientmail.sim.queue import ORDERS, simulate

    shape = ORDERS[cell.order]
    units = unit_grid(-(-cell.units // cell.learners), 1, cell.learners)
    times = [PATTERN[rank % len(PATTERN)] for rank in range(cell.learners)]
    result = simulate(
        units, times, rotate_lanes=None if shape is None else cell.learners, jitter=JITTER, **(shape or {})
    )
    return Outcome(cell, len(units), result.requests_per_claim, result.conflicts_per_claim, result.step_spread)


def cells(unit_counts: tuple[int, ...], learner_counts: tuple[int, ...]) -> list[Cell]:
    """Every order for each size; one learner has no order to choose, so it runs once."""
    from gradientmail.sim.queue import ORDERS

    return [
        Cell(units, learners, order)
        for units in unit_counts
        for learners in learner_counts
        for order in (["mapping"] if learners == 1 else list(ORDERS))
    ]


def label(cell: Cell) -> str:
    return "any" if cell.learners == 1 else cell.order


def main(argv: list[str] | None = None) -> dict[str, object]:
    options = parser(__doc__)
    options.add_argument("--jobs", type=int, default=None, help="simulations run in parallel (default: 2, quick 1)")
    args = options.parse_args(argv)
    jobs = args.jobs or (1 if args.quick else default_jobs())
    unit_counts = QUICK_UNIT_COUNTS if args.quick else UNIT_COUNTS
    todo = cells(unit_counts, LEARNER_COUNTS)
    start = time.perf_counter()
    outcomes: list[Outcome] = parallel_map(run_cell, todo, jobs)
    wall = time.perf_counter() - start
    print(
        f"Requests per claimed unit by preference order (virtual clock, times per unit "
        f"{', '.join(f'{t:g}' for t in PATTERN)} repeated, jitter {JITTER:.0%}, listing adaptive)"
        f"{' (quick)' if args.quick else ''}"
    )
    rows = [
        [
            f"{outcome.units:,}",
            outcome.cell.learners,
            label(outcome.cell),
            f"{outcome.requests_per_claim:.3f}",
            f"{outcome.conflicts_per_claim:.3f}",
            outcome.step_spread,
        ]
        for outcome in outcomes
    ]
    print(table(HEADERS, rows))
    print(f"{len(todo)} simulations in {wall:.1f}s on {jobs} process(es)")
    largest = max(unit_counts)
    figures: dict[str, object] = {}
    for outcome in outcomes:
        if outcome.cell.units == largest and outcome.cell.learners > 1:
            suffix = f"{outcome.cell.order.replace('=', '')}_{outcome.cell.learners}"
            figures[f"orders_requests_per_claim_{suffix}"] = outcome.requests_per_claim
            figures[f"orders_conflicts_per_claim_{suffix}"] = outcome.conflicts_per_claim
            figures[f"orders_step_spread_{suffix}"] = outcome.step_spread
    figures["units"] = largest
    emit(figures)
    return figures


if __name__ == "__main__":
    main()
