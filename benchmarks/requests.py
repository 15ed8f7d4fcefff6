"""What claiming costs in mailbox requests, as the run grows, with and without lane rotation.

The claim protocol alone: each node runs the design note's queue (``resume=False``); the
default ``resume=None`` adds the progress records of docs/elastic.md, left out here.

Each cell runs ``gradientmail.sim.queue``: real ``SharedQueueDataset`` claimers of
unequal speed (times per unit 1, 2, 2, 4 repeated, each batch +-20 % jitter) on one shared
``MemoryMailbox``, each behind a ``CountingMailbox`` that counts requests the way S3 bills them
(a list page of 1,000 keys is one request; each node's start-up is included). Units are the
design note's grid with one lane per learner; "rotation" means node ``r`` prefers lane ``r`` first
(``rotated_order``), "none" that every node walks the mapping's order.

- ``requests_per_claim``: mailbox requests / units claimed, at 100k units, 64 learners,
  rotation.
- ``conflicts_per_claim``: claims lost to another node / units claimed, same run.

Their targets are ``benchmarks._common.TARGETS``, the one place every table reads them from.

The virtual clock runs each ``next()`` atomically, so no node ever acts between another's
listing and its create: a conflict there needs knowledge gone stale while a node was busy. The
second table therefore races for real: 64 threads, each its own ``SharedQueueDataset``, start
together on one ``MemoryMailbox`` behind ``DelayedMailbox`` (1 ms per request) and sleep 20, 40,
40 or 80 ms per unit, so a claim takes about 1/10 to 1/30 of a unit, as a 20 ms store does for
units of a few seconds. ``requests_per_claim_threads`` and ``conflicts_per_claim_threads`` (with
``_no_rotation``) come from it; being real timing, they vary a little from run to run.

Simulations run in parallel in ``--jobs`` processes (default 2). At 100k units only the headline
64 learners run by default, to keep ``python -m benchmarks`` within its 3 minutes; ``--full`` adds
1 and 16 learners. ``--quick``: 500 and 2,000 units (the headline figures then come from 2,000)
in one process, and 300 units for the threads.

``--repeats N`` runs every cell with jitter seeds 0 to N - 1 and each race N times: the tables
show medians and [min, max], the JSON line the medians and each headline figure's ``_range``.

Usage: ``python -m benchmarks.requests [--quick] [--full] [--repeats N] [--jobs N]``; the last line
is one JSON object.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from benchmarks._common import default_jobs, emit, parallel_map, parser, table, verdicts

UNIT_COUNTS = (1_000, 10_000, 100_000)
QUICK_UNIT_COUNTS = (500, 2_000)
LEARNER_COUNTS = (1, 16, 64)
HEADLINE_LEARNERS = 64
PATTERN = (1.0, 2.0, 2.0, 4.0)
JITTER = 0.2
RACE_UNITS, QUICK_RACE_UNITS = 2_000, 300
RACE_LATENCY_S = 0.001
RACE_UNIT_S = 0.020  # seconds per unit at relative time 1


@dataclass(frozen=True)
class Cell:
    units: int
    learners: int
    rotation: bool

    @property
    def label(self) -> str:
        return "-" if self.learners == 1 else ("rotation" if self.rotation else "none")


@dataclass(frozen=True)
class Outcome:
    cell: Cell
    claims: int
    requests: int
    conflicts: int
    listings: int
    by_operation: dict[str, int]
    seconds: float

    @property
    def requests_per_claim(self) -> float:
        return self.requests / max(1, self.claims)

    @property
    def conflicts_per_claim(self) -> float:
        return self.conflicts / max(1, self.claims)


def run_cell(job: Cell | tuple[Cell, int]) -> Outcome:
    """One simulation of a cell, or of ``(cell, seed)`` (module-level: cells run in worker processes)."""
    from benchmarks.balance import grid
    from gradientmail.sim.queue import simulate

    cell, seed = job if isinstance(job, tuple) else (job, 0)
    times = [PATTERN[rank % len(PATTERN)] for rank in range(cell.learners)]
    units = grid(cell.units, cell.learners)
    start = time.perf_counter()
    result = simulate(units, times, rotate_lanes=cell.learners if cell.rotation else None, jitter=JITTER, seed=seed)
    seconds = time.perf_counter() - start
    return Outcome(
        cell=cell,
        claims=result.claims,
        requests=sum(result.requests.values()),
        conflicts=result.claim_stats["conflicts"],
        listings=result.claim_stats["listings"],
        by_operation=dict(result.requests),
        seconds=seconds,
    )


def _one_batch(unit: object) -> Iterator[tuple[int, torch.Tensor]]:
    yield 0, torch.zeros(())


def race(units_count: int, learners: int, rotation: bool) -> Outcome:
    """Threads claiming for real through one store with latency; see the module docstring."""
    from benchmarks.balance import grid
    from gradientmail import SharedQueueDataset, rotated_order
    from gradientmail.mailbox.memory import MemoryMailbox
    from gradientmail.mailbox.wrappers import CountingMailbox, DelayedMailbox

    units = grid(units_count, learners)
    store = MemoryMailbox(f"bench-race-{uuid.uuid4().hex}")
    counters = [CountingMailbox(store) for _ in range(learners)]
    datasets = [
        SharedQueueDataset(
            units,
            mailbox=DelayedMailbox(counters[rank], RACE_LATENCY_S),
            learner_id=f"node-{rank}",
            load=_one_batch,
            order=rotated_order(units, rank, learners) if rotation else None,
        )
        for rank in range(learners)
    ]
    start_line = threading.Barrier(learners)
    errors: list[BaseException] = []

    def node(rank: int) -> None:
        try:
            start_line.wait()
            for _ in datasets[rank]:
                time.sleep(RACE_UNIT_S * PATTERN[rank % len(PATTERN)])
        except BaseException as exc:  # reported below, on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=node, args=(rank,), daemon=True) for rank in range(learners)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    store.clear()
    if errors:
        raise errors[0]
    stats: Counter[str] = Counter()
    operations: Counter[str] = Counter()
    for dataset, counter in zip(datasets, counters, strict=True):
        stats.update(dataset.claim_stats)
        operations.update(counter.counts)
    if stats["claims"] != units_count:
        raise RuntimeError(f"race: {stats['claims']} claims for {units_count} units")
    return Outcome(
        cell=Cell(units_count, learners, rotation),
        claims=stats["claims"],
        requests=sum(operations.values()),
        conflicts=stats["conflicts"],
        listings=stats["listings"],
        by_operation=dict(operations),
        seconds=seconds,
    )


HEADERS = ["units", "learners", "rotation", "requests/claim", "conflicts/claim", "lists", "creates", "gets", "sim time"]


def spread(values: list[float], digits: int) -> str:
    """The median alone for one value, else ``median [min, max]``."""
    middle = f"{statistics.median(values):.{digits}f}"
    return middle if len(values) == 1 else f"{middle} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def row(outcomes: Outcome | list[Outcome]) -> list[object]:
    """One table row: a cell's figures, medians and ranges over its repeats."""
    runs = outcomes if isinstance(outcomes, list) else [outcomes]
    cell = runs[0].cell

    def per_claim(operation: str) -> float:
        return statistics.median(run.by_operation.get(operation, 0) / max(1, run.claims) for run in runs)

    return [
        f"{cell.units:,}",
        cell.learners,
        cell.label,
        spread([run.requests_per_claim for run in runs], 3),
        spread([run.conflicts_per_claim for run in runs], 4),
        f"{per_claim('list'):.3f}",
        f"{per_claim('put_if_absent'):.3f}",
        f"{per_claim('get'):.3f}",
        f"{statistics.median(run.seconds for run in runs):.1f}s",
    ]


def cells(unit_counts: tuple[int, ...], full: bool = True) -> list[Cell]:
    """The grid; without ``full``, the largest unit count only with the headline learners."""
    result = []
    for units, learners in itertools.product(unit_counts, LEARNER_COUNTS):
        if not full and units == max(unit_counts) and learners != HEADLINE_LEARNERS:
            continue
        for rotation in (True,) if learners == 1 else (True, False):
            result.append(Cell(units, learners, rotation))
    return result


def run_all(todo: list[Cell], jobs: int, repeats: int = 1) -> dict[Cell, list[Outcome]]:
    """Every cell with jitter seeds ``0 .. repeats - 1``: its outcomes, by seed."""
    # Largest first, so that the slowest cell never starts last.
    ordered = sorted(todo, key=lambda cell: cell.units * max(cell.learners, 4), reverse=True)
    runs = [(cell, seed) for cell in ordered for seed in range(repeats)]
    outcomes: dict[Cell, list[Outcome]] = {cell: [] for cell in ordered}
    for (cell, _), outcome in zip(runs, parallel_map(run_cell, runs, jobs), strict=True):
        outcomes[cell].append(outcome)
    return outcomes


def main(argv: list[str] | None = None) -> dict[str, float]:
    options = parser(__doc__)
    options.add_argument("--jobs", type=int, default=None, help="simulations run in parallel (default: 2, quick 1)")
    options.add_argument(
        "--full", action="store_true", help="also 100k units with 1 and 16 learners (about a minute more)"
    )
    options.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per cell (jitter seeds 0, 1, ...) and per race: medians and [min, max] (default 1)",
    )
    args = options.parse_args(argv)
    if args.repeats < 1:
        options.error("--repeats must be at least 1")
    jobs = args.jobs or (1 if args.quick else default_jobs())
    unit_counts = QUICK_UNIT_COUNTS if args.quick else UNIT_COUNTS
    todo = cells(unit_counts, full=args.full or args.quick)
    start = time.perf_counter()
    outcomes = run_all(todo, jobs, args.repeats)
    wall = time.perf_counter() - start

    print(
        f"Mailbox requests per claimed unit (virtual clock, times per unit "
        f"{', '.join(f'{t:g}' for t in PATTERN)} repeated, jitter {JITTER:.0%})"
        f"{' (quick)' if args.quick else ''}"
        + ("" if args.repeats == 1 else f"; {args.repeats} runs per cell (jitter seeds), median [min, max]")
    )
    print(table(HEADERS, [row(outcomes[cell]) for cell in todo]))
    print(f"{len(todo) * args.repeats} simulations in {wall:.1f}s on {jobs} process(es)")

    race_units = QUICK_RACE_UNITS if args.quick else RACE_UNITS
    raced = [[race(race_units, HEADLINE_LEARNERS, rotation) for _ in range(args.repeats)] for rotation in (True, False)]
    print()
    print(
        f"Racing for real: {HEADLINE_LEARNERS} threads, {RACE_LATENCY_S * 1e3:g} ms per request, "
        f"{RACE_UNIT_S * 1e3:g} ms per unit at relative time 1"
        + ("" if args.repeats == 1 else f"; {args.repeats} races each, median [min, max]")
    )
    print(table(HEADERS[:-1] + ["wall time"], [row(runs) for runs in raced]))

    largest = max(unit_counts)
    named = {
        "": outcomes[Cell(largest, HEADLINE_LEARNERS, True)],
        "_no_rotation": outcomes[Cell(largest, HEADLINE_LEARNERS, False)],
        "_threads": raced[0],
        "_threads_no_rotation": raced[1],
    }
    figures: dict[str, object] = {}
    for suffix, runs in named.items():
        for name in ("requests_per_claim", "conflicts_per_claim"):
            values = [getattr(run, name) for run in runs]
            figures[f"{name}{suffix}"] = statistics.median(values)
            figures[f"{name}{suffix}_range"] = [min(values), max(values)]
    figures["worst_requests_per_claim"] = max(
        statistics.median(run.requests_per_claim for run in runs) for runs in outcomes.values()
    )
    figures["units"] = largest
    figures["learners"] = HEADLINE_LEARNERS
    figures["repeats"] = args.repeats
    for line in verdicts({name: figures[name] for name in ("requests_per_claim", "conflicts_per_claim")}):
        print(f"{line} (virtual clock, {largest:,} units, {HEADLINE_LEARNERS} learners, rotation)")
    for line in verdicts({"conflicts_per_claim_threads": figures["conflicts_per_claim_threads"]}):
        print(f"{line} (threads racing for real, {race_units:,} units, {HEADLINE_LEARNERS} learners, rotation)")
    emit(figures)
    return figures


if __name__ == "__main__":
    main()
