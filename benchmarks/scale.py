"""How the shared queue and its simulation scale, towards 1M units over 1,024 nodes.

The balance and requests benchmarks at growing sizes on the virtual clock
(``gradientmail.sim.queue``: real ``SharedQueueDataset`` claimers on one ``MemoryMailbox``,
times per unit 1, 2, 2, 4 repeated, each batch +-20 % jitter, one lane per node with rotation),
with what the simulation itself costs: its wall time and memory per simulated node.

- A ladder of sizes at about 1,000 units per node (the ratio of 1M units to 1,024 nodes: 64k
  over 64, 256k over 256, 512k over 512): each row is one full simulation, with makespan / fluid bound (total work / total speed), requests
  per claim, its wall time and RSS growth per node (measured in a fresh process).
- One node's start-up at the target size (1M units, 1,024 lanes), built as ``simulate`` builds
  it: its preference order as sorted positions (``simulate.rotated_positions``: 4 bytes a
  unit, derived arithmetically from rank 0's rotated order) and its ``Claimer`` over the shared
  claim index. The claim index, rank 0's order and the unit fingerprint are built once per
  simulation, not per node. Its time and memory (``tracemalloc``) are measured, not estimated.
- ``sim_wall_s_1m_estimate``: the 1M/1,024 wall time extrapolated as 1,024 times that start-up
  plus 1M claims at the per-claim cost of the ladder, grown linearly with nodes from its last
  two rows (``_flat``: not grown past the last row).
- ``shared_over_bound_1m``, ``requests_per_claim_1m``, ``sim_wall_s_1m``, ``sim_cpu_s_1m`` and
  ``rss_mb_per_node_1m`` come from the direct simulation at the target size, which runs only
  with ``--direct`` (over 20 CPU minutes at 1M units, almost all in the claim protocol itself)
  and under ``--quick`` (where the target is small); otherwise they are null. ``sim_cpu_s_1m`` is the simulation's CPU time: on a machine shared with other work the wall
  time counts their time too.

``--quick``: a ladder of 2k/8 and 4k/16 and a target of 20k units over 64 nodes, run directly.

``--repeats N`` runs every size N times with jitter seeds 0 to N - 1: the table shows each
figure's median and [min, max], the JSON line the medians (and ``_range`` lists); per size the
figures are also named by nodes (``requests_per_claim_n512``, ``step_spread_n1024``, ...).

Usage: ``python -m benchmarks.scale [--quick] [--direct] [--repeats N] [--jobs N]``; the last line
is one JSON object.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import resource
import statistics
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks._common import default_jobs, emit, parser, table, verdicts

PATTERN = (1.0, 2.0, 2.0, 4.0)
JITTER = 0.2
TARGET = (1_000_000, 1_024)
LADDER = ((64_000, 64), (256_000, 256), (512_000, 512))
QUICK_TARGET = (20_000, 64)
QUICK_LADDER = ((2_000, 8), (4_000, 16))


def unit_times(nodes: int) -> list[float]:
    return [PATTERN[rank % len(PATTERN)] for rank in range(nodes)]


def fluid_bound(units: int, nodes: int) -> float:
    """Total work / total speed (jitter is centred: it leaves the expected work unchanged)."""
    return units / sum(1.0 / t for t in unit_times(nodes))


def _max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


@dataclass(frozen=True)
class Row:
    units: int
    nodes: int
    shared_over_bound: float
    requests_per_claim: float
    conflicts_per_claim: float
    seconds: float
    rss_mb_per_node: float
    cpu_seconds: float = 0.0
    """CPU time of the simulation's process: on a shared machine, wall time also counts others' work."""
    step_spread: int = 0
    """Largest difference between the steps two nodes were processing at the same time."""
    seed: int = 0
    """The jitter's seed (one per repeat)."""


@dataclass(frozen=True)
class Repeats:
    """The rows of one size over its repeats (seeds 0, 1, ...): medians and ranges."""

    rows: tuple[Row, ...]

    @property
    def units(self) -> int:
        return self.rows[0].units

    @property
    def nodes(self) -> int:
        return self.rows[0].nodes

    def median(self, name: str) -> float:
        return statistics.median(getattr(row, name) for row in self.rows)

    def range(self, name: str) -> list[float]:
        values = [getattr(row, name) for row in self.rows]
        return [min(values), max(values)]

    def text(self, name: str, digits: int) -> str:
        """``median`` alone for one repeat, else ``median [min, max]``."""
        middle = f"{self.median(name):.{digits}f}"
        if len(self.rows) == 1:
            return middle
        low, high = self.range(name)
        return f"{middle} [{low:.{digits}f}, {high:.{digits}f}]"

    def typical(self) -> Row:
        """A row with each figure's median (for the extrapolation, which takes rows)."""
        first = self.rows[0]
        return Row(
            units=first.units,
            nodes=first.nodes,
            shared_over_bound=self.median("shared_over_bound"),
            requests_per_claim=self.median("requests_per_claim"),
            conflicts_per_claim=self.median("conflicts_per_claim"),
            seconds=self.median("seconds"),
            rss_mb_per_node=self.median("rss_mb_per_node"),
            cpu_seconds=self.median("cpu_seconds"),
            step_spread=int(self.median("step_spread")),
        )


def run_sizes(sizes: Sequence[tuple[int, int]], jobs: int, repeats: int = 1) -> list[Repeats]:
    """``run_size`` for each size and seed ``0 .. repeats - 1``, each in a fresh process (spawn,
    one simulation per process): the peak RSS of a process that already ran a larger size would
    hide this one's growth."""
    runs = [(units, nodes, seed) for units, nodes in sizes for seed in range(repeats)]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max(1, jobs), mp_context=context, max_tasks_per_child=1) as pool:
        rows = list(pool.map(run_size, runs))
    return [Repeats(tuple(rows[at : at + repeats])) for at in range(0, len(rows), repeats)]


def run_size(size: tuple[int, ...]) -> Row:
    """One full simulation of ``(units, nodes[, seed])`` (module-level: sizes run in fresh
    worker processes)."""
    from benchmarks.balance import grid
    from gradientmail.sim.queue import simulate

    units, nodes, seed = (*size, 0)[:3]
    mapping = grid(units, nodes)
    before = _max_rss_mb()
    start, cpu = time.perf_counter(), time.process_time()
    result = simulate(mapping, unit_times(nodes), rotate_lanes=nodes, jitter=JITTER, seed=seed)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    if result.claims != units:
        raise RuntimeError(f"{units} units over {nodes} nodes: {result.claims} claimed")
    return Row(
        units=units,
        nodes=nodes,
        shared_over_bound=result.makespan / fluid_bound(units, nodes),
        requests_per_claim=result.requests_per_claim,
        conflicts_per_claim=result.conflicts_per_claim,
        seconds=seconds,
        rss_mb_per_node=(_max_rss_mb() - before) / nodes,
        cpu_seconds=cpu,
        step_spread=result.step_spread,
        seed=seed,
    )


@dataclass(frozen=True)
class NodeCost:
    """One simulated node's start-up at a given size: seconds by part, and bytes it keeps."""

    order_s: float
    claimer_s: float
    fingerprint_s: float
    memory_bytes: int

    @property
    def seconds(self) -> float:
        return self.order_s + self.claimer_s + self.fingerprint_s


def node_cost(size: tuple[int, int]) -> NodeCost:
    """Build one node's per-node state as ``simulate`` does, timing each part (no tracing), then
    again under ``tracemalloc`` for the memory it keeps (the claim index is shared, not counted).

    ``simulate`` builds the claim index, rank 0's rotated order and the unit fingerprint once
    for all nodes; per node it derives its order as sorted positions (``rotated_positions``) and
    builds its ``Claimer``. ``fingerprint_s`` is therefore 0 (kept for the table's shape)."""
    from benchmarks.balance import grid
    from gradientmail.mailbox.memory import MemoryMailbox
    from gradientmail.queue.claim_index import ClaimIndex
    from gradientmail.queue.claimer import Claimer
    from gradientmail.sim.queue import rotated_positions

    units, nodes = size
    mapping = grid(units, nodes)
    index = ClaimIndex(mapping)
    mailbox = MemoryMailbox(f"bench-scale-{time.time_ns()}")
    orders = rotated_positions(index, list(mapping), 3, nodes)  # ranks 0 to 2 of `nodes` lanes
    next(orders)  # rank 0 pays the shared set-up; rank 1 is a typical node
    start = time.perf_counter()
    order = next(orders)
    ordered = time.perf_counter()
    Claimer(mailbox, order, "node-1", index=index)
    built = time.perf_counter()
    del order
    tracemalloc.start()
    try:
        kept = (next(orders),)
        kept += (Claimer(mailbox, kept[0], "node-2", index=index),)
        memory, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return NodeCost(ordered - start, built - ordered, 0.0, memory)


def per_claim_at(rows: list[Row], costs: dict[tuple[int, int], NodeCost], nodes: int) -> float:
    """Seconds per claim of the claim loop (wall less the nodes' start-up), grown linearly with
    nodes from the last two rows to ``nodes`` (never below the last row's)."""
    loop = [(row.nodes, (row.seconds - row.nodes * costs[(row.units, row.nodes)].seconds) / row.units) for row in rows]
    loop = [(n, max(per_claim, 0.0)) for n, per_claim in loop]
    if len(loop) == 1:
        return loop[0][1]
    (n0, c0), (n1, c1) = loop[-2], loop[-1]
    slope = max(0.0, (c1 - c0) / (n1 - n0))
    return c1 + slope * (nodes - n1)


def main(argv: list[str] | None = None) -> dict[str, object]:
    options = parser(__doc__)
    options.add_argument("--jobs", type=int, default=None, help="simulations in parallel (default: 2, quick 1)")
    options.add_argument(
        "--direct", action="store_true", help="also simulate the target size itself (1M units, 1,024 nodes: long)"
    )
    options.add_argument(
        "--repeats", type=int, default=1, help="simulations per size, jitter seeds 0, 1, ... (default 1)"
    )
    args = options.parse_args(argv)
    if args.repeats < 1:
        options.error("--repeats must be at least 1")
    ladder = list(QUICK_LADDER if args.quick else LADDER)
    target = QUICK_TARGET if args.quick else TARGET
    jobs = args.jobs or (1 if args.quick else default_jobs())

    start = time.perf_counter()
    # Largest first, so that it never starts last.
    sizes = sorted(run_sizes(sorted(ladder, reverse=True), jobs, args.repeats), key=lambda size: size.units)
    rows = [size.typical() for size in sizes]
    costs = {size: node_cost(size) for size in [*ladder, target]}
    direct = run_sizes([target], 1, args.repeats)[0] if args.quick or args.direct else None
    wall = time.perf_counter() - start

    units, nodes = target
    at_target = costs[target]
    per_claim = per_claim_at(rows, costs, nodes)
    setup = nodes * at_target.seconds
    estimate = setup + units * per_claim
    flat = setup + units * per_claim_at(rows[-1:], costs, nodes)  # no growth past the last row

    print(
        f"Scale on a virtual clock: times per unit {', '.join(f'{t:g}' for t in PATTERN)} repeated, "
        f"jitter {JITTER:.0%}, rotation{' (quick)' if args.quick else ''}"
        + ("" if args.repeats == 1 else f"; {args.repeats} runs per size (jitter seeds), median [min, max]")
    )
    shown = [*sizes, *([direct] if direct is not None else [])]
    print(
        table(
            [
                "units",
                "nodes",
                "makespan/bound",
                "requests/claim",
                "conflicts/claim",
                "step spread",
                "sim time",
                "sim CPU",
                "node start-up",
                "RSS/node",
            ],
            [
                [
                    f"{size.units:,}",
                    size.nodes,
                    size.text("shared_over_bound", 4),
                    size.text("requests_per_claim", 3),
                    size.text("conflicts_per_claim", 4),
                    size.text("step_spread", 0),
                    f"{size.median('seconds'):.1f}s",
                    f"{size.median('cpu_seconds'):.1f}s",
                    f"{costs[(size.units, size.nodes)].seconds * 1e3:.0f}ms",
                    f"{size.median('rss_mb_per_node'):.2f}MB",
                ]
                for size in shown
            ],
        )
    )
    print()
    print(
        f"One node's start-up at {units:,} units, {nodes:,} lanes: rotated order "
        f"{at_target.order_s * 1e3:.0f} ms (positions), claimer {at_target.claimer_s * 1e3:.0f} ms; keeps "
        f"{at_target.memory_bytes / 2**20:.1f} MB (tracemalloc; the claim index, rank 0's order and the "
        f"unit fingerprint are built once per simulation)"
    )
    print(
        f"{units:,} units over {nodes:,} nodes, extrapolated: start-up {nodes:,} x "
        f"{at_target.seconds:.2f} s = {setup:.0f} s, claim loop {units:,} x {per_claim * 1e6:.0f} us "
        f"= {units * per_claim:.0f} s; about {estimate:.0f} s in all ({flat:.0f} s if the cost per "
        f"claim stopped growing at {rows[-1].nodes} nodes), "
        f"{nodes * at_target.memory_bytes / 2**30:.1f} GB of per-node state"
        + (
            ""
            if direct is None
            else f" (measured directly: {direct.text('seconds', 1)} s, {direct.text('cpu_seconds', 1)} s CPU)"
        )
    )
    print(
        f"{sum(len(size.rows) for size in shown)} simulations and {len(costs)} start-ups in {wall:.1f}s on {jobs} process(es)"
    )

    largest = rows[-1]
    figures: dict[str, object] = {
        "shared_over_bound_1m": None if direct is None else direct.median("shared_over_bound"),
        "requests_per_claim_1m": None if direct is None else direct.median("requests_per_claim"),
        "conflicts_per_claim_1m": None if direct is None else direct.median("conflicts_per_claim"),
        "step_spread_1m": None if direct is None else direct.median("step_spread"),
        "sim_wall_s_1m": None if direct is None else direct.median("seconds"),
        "sim_cpu_s_1m": None if direct is None else direct.median("cpu_seconds"),
        "rss_mb_per_node_1m": None if direct is None else direct.median("rss_mb_per_node"),
        "sim_wall_s_1m_estimate": estimate,
        "sim_wall_s_1m_estimate_flat": flat,
        "node_startup_s_1m": at_target.seconds,
        "memory_mb_per_node_1m": at_target.memory_bytes / 2**20,
        "shared_over_bound_ladder": largest.shared_over_bound,
        "requests_per_claim_ladder": largest.requests_per_claim,
        "sim_wall_s_ladder": largest.seconds,
        "sim_cpu_s_ladder": largest.cpu_seconds,
        "rss_mb_per_node_ladder": largest.rss_mb_per_node,
        "claim_loop_us_1m": per_claim * 1e6,
        "ladder_units": largest.units,
        "ladder_nodes": largest.nodes,
        "target_units": units,
        "target_nodes": nodes,
        "repeats": args.repeats,
    }
    # Per size (medians over the repeats, and [min, max]): ``_n64``, ``_n256``, ... ``_n1024``.
    for size in shown:
        for name in ("shared_over_bound", "requests_per_claim", "conflicts_per_claim", "step_spread"):
            figures[f"{name}_n{size.nodes}"] = size.median(name)
            figures[f"{name}_n{size.nodes}_range"] = size.range(name)
    if direct is not None:
        for name in ("shared_over_bound", "requests_per_claim", "conflicts_per_claim", "sim_wall_s", "sim_cpu_s"):
            field = {"sim_wall_s": "seconds", "sim_cpu_s": "cpu_seconds"}.get(name, name)
            figures[f"{name}_1m_range"] = direct.range(field)
    measured = {name: value for name, value in figures.items() if isinstance(value, float)}
    for line in verdicts(
        {
            name: measured[name]
            for name in ("shared_over_bound_1m", "sim_wall_s_1m", "sim_wall_s_1m_estimate")
            if name in measured
        }
    ):
        print(line)
    emit(figures)
    return figures


if __name__ == "__main__":
    main()
