"""How close the shared queue comes to perfect balance, against a fixed split, on a virtual clock.

Nodes of unequal speed drain one set of work units. Every node is a real ``SharedQueueDataset``
claiming through one shared ``MemoryMailbox`` (``gradientmail.sim.queue``); only the
clock is virtual: the node whose clock is lowest asks for its next batch, so nothing sleeps.

- ``shared_over_bound``: shared-queue makespan / the fluid lower bound (total work / total
  speed: no schedule of whole units can finish sooner), at 64 nodes; target <= 1.05.
- ``fixed_over_bound``: the same for a fixed split (``DistributedSampler``-style: every node
  owns ``ceil(units / nodes)`` units whatever its speed), at 64 nodes.

Node times per unit repeat the design note's 1, 2, 2, 4 (64 nodes: 16 of each kind). The slowdown run
has 64 nodes and makes node 0 (a fast one) four times slower from half the ideal makespan on.
The design note's 24-unit example is reproduced exactly first (fixed split t = 24, shared queue t = 12
with A 11, B and C 5, D 3 units). ``--quick``: 500 units instead of 10,000, in one process.

Usage: ``python -m benchmarks.balance [--quick]``; the last line is one JSON object.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks._common import default_jobs, emit, parallel_map, parser, table, verdicts
from gradientmail import Unit, unit_grid
from gradientmail.sim.queue import fixed_split_makespan, simulate

PATTERN = (1.0, 2.0, 2.0, 4.0)
"""Time per unit of the design note's nodes A, B, C and D, repeated over larger clusters."""

NODE_COUNTS = (4, 64, 256)
HEADLINE_NODES = 64
SLOWDOWN_FACTOR = 4.0
DOCUMENTED_UNITS = {"node-0": 11, "node-1": 5, "node-2": 5, "node-3": 3}
"""Units per node in the design note's example: A claims 11, B and C 5 each, D 3."""


def unit_times(nodes: int) -> list[float]:
    return [PATTERN[rank % len(PATTERN)] for rank in range(nodes)]


def grid(units: int, lanes: int) -> dict[str, Unit]:
    """Exactly ``units`` one-batch units of the design note's grid, one lane per node (for rotation)."""
    full = unit_grid(steps=-(-units // lanes), unit_steps=1, lanes=lanes)
    return dict(itertools.islice(full.items(), units))


class SlowingTimes(Sequence[float]):
    """``unit_times`` for ``simulate`` where node ``node`` becomes ``factor`` times slower at ``at``.

    ``simulate`` reads ``unit_times[rank]`` once per batch a node processes, and with one-batch
    units and no jitter that is the batch's whole cost; so this sequence can keep each node's
    virtual clock itself and answer with the time of the batch starting now (a unit started
    before ``at`` keeps the old speed, as in the notebook). ``check`` compares those clocks with
    the finish times ``simulate`` reports, so a change in how it reads the times cannot go
    unnoticed.
    """

    def __init__(self, base: Sequence[float], node: int, factor: float, at: float) -> None:
        self.base = list(base)
        self.node, self.factor, self.at = node, factor, at
        self.clock = [0.0] * len(self.base)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, rank):  # type: ignore[override]
        if isinstance(rank, slice):
            return self.base[rank]
        cost = self.base[rank]
        if rank == self.node and self.clock[rank] >= self.at:
            cost *= self.factor
        self.clock[rank] += cost
        return cost

    def check(self, finish: dict[str, float]) -> None:
        for rank, clock in enumerate(self.clock):
            reported = finish[f"node-{rank}"]
            if not math.isclose(reported, clock, rel_tol=1e-9, abs_tol=1e-9):
                raise RuntimeError(
                    f"simulate() does not read unit_times once per batch (node-{rank}: "
                    f"finished at {reported}, this benchmark's clock says {clock}); "
                    "the slowdown run needs updating"
                )


def fluid_bound(units: int, times: Sequence[float], slow: tuple[int, float, float] | None = None) -> float:
    """Total work / total speed; with ``slow = (node, factor, at)`` the speed drops at ``at``."""
    speed = sum(1.0 / t for t in times)
    if slow is None:
        return units / speed
    node, factor, at = slow
    if units <= speed * at:
        return units / speed
    slower = speed - (1.0 / times[node]) * (1.0 - 1.0 / factor)
    return at + (units - speed * at) / slower


def fixed_split(units: int, times: Sequence[float], slow: tuple[int, float, float] | None = None) -> float:
    """Makespan when every node owns ``ceil(units / nodes)`` units (with an optional slowdown)."""
    if slow is None:
        return fixed_split_makespan(units, times)
    per_node = -(-units // len(times))
    node, factor, at = slow
    finish = []
    for rank, cost in enumerate(times):
        clock = 0.0
        for _ in range(per_node):
            clock += cost * (factor if rank == node and clock >= at else 1.0)
        finish.append(clock)
    return max(finish)


@dataclass
class Case:
    name: str
    nodes: int
    units: int
    bound: float
    shared: float
    fixed: float
    units_by_learner: dict[str, int]
    seconds: float

    @property
    def shared_over_bound(self) -> float:
        return self.shared / self.bound

    @property
    def fixed_over_bound(self) -> float:
        return self.fixed / self.bound


def run_case(name: str, nodes: int, units: int, slowdown: bool = False) -> Case:
    """One case on the virtual clock (module-level: cases run in worker processes)."""
    times = unit_times(nodes)
    slow = None
    if slowdown:
        slow = (0, SLOWDOWN_FACTOR, fluid_bound(units, times) / 2)
        speeds: Sequence[float] = SlowingTimes(times, *slow)
    else:
        speeds = times
    start = time.perf_counter()
    result = simulate(grid(units, nodes), speeds, rotate_lanes=nodes)
    seconds = time.perf_counter() - start
    if isinstance(speeds, SlowingTimes):
        speeds.check(result.finish)
    if result.claims != units:
        raise RuntimeError(f"{name}: {result.claims} units claimed of {units}")
    return Case(
        name=name,
        nodes=nodes,
        units=units,
        bound=fluid_bound(units, times, slow),
        shared=result.makespan,
        fixed=fixed_split(units, times, slow),
        units_by_learner=result.units_by_learner,
        seconds=seconds,
    )


def _run_case(arguments: tuple[str, int, int, bool]) -> Case:
    return run_case(*arguments)


def main(argv: list[str] | None = None) -> dict[str, object]:
    options = parser(__doc__)
    options.add_argument("--jobs", type=int, default=None, help="cases run in parallel (default: 2, quick 1)")
    args = options.parse_args(argv)
    units = 500 if args.quick else 10_000
    jobs = args.jobs or (1 if args.quick else default_jobs())  # starting a process costs more than a quick case

    documented = run_case("design note example", 4, 24)
    documented_units = [documented.units_by_learner[f"node-{rank}"] for rank in range(4)]
    reproduced = (
        documented.shared == 12.0 and documented.fixed == 24.0 and documented.units_by_learner == DOCUMENTED_UNITS
    )
    todo = [(f"{nodes} nodes", nodes, units, False) for nodes in NODE_COUNTS]
    todo.append((f"{HEADLINE_NODES} nodes, one 4x slower halfway", HEADLINE_NODES, units, True))
    # The largest case first, so that it never starts last.
    order = sorted(range(len(todo)), key=lambda index: -todo[index][1])
    done = parallel_map(_run_case, [todo[index] for index in order], jobs)
    cases = [case for _, case in sorted(zip(order, done, strict=True), key=lambda pair: pair[0])]

    print(
        f"Balance on a virtual clock: node times per unit {', '.join(f'{t:g}' for t in PATTERN)} repeated, "
        f"one batch per unit{' (quick)' if args.quick else ''}"
    )
    rows = []
    for case in [documented, *cases]:
        rows.append(
            [
                case.name,
                case.nodes,
                f"{case.units:,}",
                f"{case.bound:.2f}",
                f"{case.shared:.2f}",
                f"{case.shared_over_bound:.3f}",
                f"{case.fixed:.2f}",
                f"{case.fixed_over_bound:.3f}",
                f"{case.fixed / case.shared:.2f}x",
                f"{case.seconds:.1f}s",
            ]
        )
    print(
        table(
            [
                "case",
                "nodes",
                "units",
                "fluid bound",
                "shared queue",
                "/bound",
                "fixed split",
                "/bound",
                "fixed/shared",
                "sim time",
            ],
            rows,
        )
    )
    names = "ABCD"
    print(
        f"design note example: shared queue t = {documented.shared:g} with "
        + ", ".join(f"{names[rank]} {count}" for rank, count in enumerate(documented_units))
        + f"; fixed split t = {documented.fixed:g}: "
        + ("reproduced exactly" if reproduced else "MISMATCH (expected t = 12 with A 11, B 5, C 5, D 3; fixed 24)")
    )

    by_nodes = {case.nodes: case for case in cases[: len(NODE_COUNTS)]}
    slowdown = cases[-1]
    headline = by_nodes[HEADLINE_NODES]
    figures: dict[str, object] = {
        "shared_over_bound": headline.shared_over_bound,
        "fixed_over_bound": headline.fixed_over_bound,
    }
    for nodes, case in by_nodes.items():
        figures[f"shared_over_bound_{nodes}"] = case.shared_over_bound
        figures[f"fixed_over_bound_{nodes}"] = case.fixed_over_bound
    figures["shared_over_bound_slowdown"] = slowdown.shared_over_bound
    figures["fixed_over_bound_slowdown"] = slowdown.fixed_over_bound
    figures["documented_makespan"] = documented.shared
    figures["documented_fixed_makespan"] = documented.fixed
    figures["documented_units"] = documented_units
    figures["units"] = units
    for line in verdicts({"shared_over_bound": headline.shared_over_bound}):
        print(line)
    emit(figures)
    return figures


if __name__ == "__main__":
    main()
