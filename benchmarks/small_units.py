"""The documented case at every unit size: four node processes of speeds 1:2:2:4 drain 24 units.

Each node is a real process running the documented loop (``shared_queue`` beside a
``Session``) on one fresh ``LocalMailbox``; a batch's training is a sleep of the node's time per
batch, so the schedule, not the CPU, sets the makespan. A *time unit* is node A's time for one
unit of work: the ideal makespan is 12 of them (A 11 units, B and C 5, D 3), a fixed split 24.

- ``small_units_makespan``: makespan / time unit with **one-batch units** and ``shared_queue``'s
  default options (``prefetch=8``, ``workers=1``, the mapping's order); median of the repeats.
  ``small_units_fastest`` is the fastest node's units in the same runs (ideal 11).
- ``small_units_makespan_workers0``: the same with ``prefetch=2, workers=0``.
- ``demo_units_makespan``: four batches a unit with the demo's options (``prefetch=2,
  workers=0``), the ``gradientmail demo`` case.
- ``small_units_over_bound_240``: 240 one-batch units and the defaults, where the endgame
  begins mid-run: makespan / the fluid bound (240 units / 2.25 units per time unit), with a
  time unit of ``--time-unit`` / 5 (node A trains 20 batches a second at the default).
- ``epochs_makespan``: the 24 one-batch units over 2 epochs as one run
  (``gradientmail.data.epochs``), the defaults: ideal 22 time units (A 21 units, B and C 11,
  D 5: nobody idles at the epoch's end), where two runs of one epoch each end at 24 at best.
  The same 48 units as one epoch end as late or later (docs/benchmarks.md): the gap to 22 is
  the queue's at 48 units, not the epochs'.

Every run checks that each unit was trained exactly once (its batches name their unit).

Usage: ``python -m benchmarks.small_units [--quick] [--repeats N] [--time-unit S]``; the last
line is one JSON object.
"""

from __future__ import annotations

import functools
import multiprocessing
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from benchmarks._common import emit, parser, table, verdicts

SPEEDS = (1.0, 2.0, 2.0, 4.0)
"""Time per unit of nodes A, B, C and D, in time units (the documented case)."""
UNITS = 24
IDEAL = 12.0
FIXED = 24.0


@dataclass(frozen=True)
class Case:
    """One configuration of the documented case."""

    name: str
    unit_steps: int
    options: dict[str, Any] = field(default_factory=dict)
    units: int = UNITS
    scale: float = 1.0  # of the time unit
    epochs: int = 1  # passes over the units, as one run


EPOCHS_IDEAL = 22.0
"""The documented case over 2 epochs as one run: A, B, C and D train 21, 11, 11 and 5 units."""


CASES = (
    Case("small_units_makespan", 1),
    Case("small_units_makespan_workers0", 1, {"prefetch": 2, "workers": 0}),
    Case("demo_units_makespan", 4, {"prefetch": 2, "workers": 0}),
    Case("small_units_over_bound_240", 1, units=240, scale=0.2),
    Case("epochs_makespan", 1, epochs=2),
)


def load(unit: Any, unit_steps: int) -> Iterator[tuple[int, Any]]:
    """A unit's batches; each names its unit (epoch, group, lane) so the run can be checked."""
    import torch

    epoch = getattr(unit, "epoch", 0)
    unit = getattr(unit, "unit", unit)  # an ``EpochUnit``'s grid unit
    for step in range(unit.first, unit.first + unit.count):
        yield step, torch.tensor([epoch, unit.first // unit_steps, unit.lane, step])


def _node(
    rank: int, directory: str, case: Case, time_unit: float, start_at: float, results: Any, start_method: str
) -> None:
    """One node process: reports ``(rank, [(unit, started, ended), ...])`` or ``(rank, error)``.

    Its DataLoader workers start the way a user's script would start them (``start_method``:
    this platform's default), not the way the benchmark starts its nodes.
    """
    multiprocessing.set_start_method(start_method, force=True)
    try:
        results.put((rank, _train(rank, directory, case, time_unit, start_at)))
    except BaseException as exc:
        results.put((rank, f"{type(exc).__name__}: {exc}"))
        raise


def _train(rank: int, directory: str, case: Case, time_unit: float, start_at: float) -> list[tuple[str, float, float]]:
    """The documented loop, a sleep of the node's time per batch standing for its training step."""
    import torch

    from gradientmail import Session, unit_grid
    from gradientmail.data import epochs
    from gradientmail.mailbox.local import LocalMailbox
    from gradientmail.patterns.shared_queue import shared_queue

    torch.set_num_threads(1)
    box = LocalMailbox(directory)
    lanes = len(SPEEDS)
    units: Any = unit_grid(steps=case.units // lanes * case.unit_steps, unit_steps=case.unit_steps, lanes=lanes)
    if case.epochs > 1:
        units = epochs(units, case.epochs, seed=0)
    batch_s = SPEEDS[rank] * time_unit / case.unit_steps

    loader = functools.partial(load, unit_steps=case.unit_steps)
    model = torch.nn.Linear(4, 1)
    spans: list[tuple[str, float, float]] = []
    time.sleep(max(0.0, start_at - time.time()))
    session = Session(model, mailbox=box, learner_id=f"node-{rank}", every=timedelta(seconds=0.5))
    with session, shared_queue(units, mailbox=box, learner_id=f"node-{rank}", load=loader, **case.options) as batches:
        for _step, batch in batches:
            began = time.time()
            epoch, group, lane, _ = (int(value) for value in batch)
            time.sleep(max(0.0, began + batch_s - time.time()))  # the node's training step
            session.step(samples=1)
            spans.append((f"{epoch}/{group:06d}-{lane}.json", began, time.time()))
    return spans


def run(case: Case, time_unit: float, context: Any) -> dict[str, Any]:
    """One run of ``case``: makespan in time units, units per node, units trained twice or never."""
    start_method = multiprocessing.get_start_method()  # the platform's default, before any is set
    with tempfile.TemporaryDirectory(prefix="gm-small-units-") as directory:
        results = context.Queue()
        start_at = time.time() + 1.0
        processes = [
            context.Process(target=_node, args=(rank, directory, case, time_unit, start_at, results, start_method))
            for rank in range(len(SPEEDS))
        ]
        for process in processes:
            process.start()
        spans = dict(results.get(timeout=300) for _ in processes)
        failed = {rank: error for rank, error in spans.items() if isinstance(error, str)}
        if failed:
            raise RuntimeError(f"node processes failed: {failed}")
        for process in processes:
            process.join(timeout=60)
    batches = Counter(unit for node in spans.values() for unit, _, _ in node)
    per_node = [len({unit for unit, _, _ in spans[rank]}) for rank in range(len(SPEEDS))]
    end = max((ended for node in spans.values() for _, _, ended in node), default=start_at)
    return {
        "makespan": (end - start_at) / time_unit,
        "units": per_node,
        "wrong": sum(1 for count in batches.values() if count != case.unit_steps)
        + (case.units * case.epochs - len(batches)),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    options = parser(__doc__)
    options.add_argument("--repeats", type=int, default=None, help="runs per case (default 3, quick 1)")
    options.add_argument(
        "--time-unit", type=float, default=None, help="seconds of node A per unit (default 0.25, quick 0.1)"
    )
    args = options.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    args.time_unit = args.time_unit or (0.1 if args.quick else 0.25)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(
        ["torch", "torch.utils.data", "gradientmail", "gradientmail.patterns.shared_queue", "gradientmail.session"]
    )
    run(CASES[0], args.time_unit, context)  # warm-up, untimed: a first run pays cold caches
    figures: dict[str, Any] = {}
    rows = []
    for case in CASES:
        runs = [run(case, args.time_unit * case.scale, context) for _ in range(repeats)]
        bound = case.units / sum(1 / speed for speed in SPEEDS)  # the fluid bound, in time units
        spans = [result["makespan"] / (1.0 if case.units == UNITS else bound) for result in runs]
        figures[case.name] = statistics.median(spans)
        figures[f"{case.name}_spread"] = [min(spans), max(spans)]
        figures[f"{case.name}_wrong"] = sum(result["wrong"] for result in runs)
        if case.name == "small_units_makespan":
            figures["small_units_fastest"] = min(result["units"][0] for result in runs)
        rows.append(
            (
                case.name,
                f"{case.units} x {case.unit_steps}" + (f", {case.epochs} epochs" if case.epochs > 1 else ""),
                " ".join(f"{k}={v}" for k, v in case.options.items()) or "defaults",
                f"{statistics.median(spans):.2f} [{min(spans):.2f}, {max(spans):.2f}]",
                "; ".join("/".join(str(n) for n in result["units"]) for result in runs),
                sum(result["wrong"] for result in runs),
            )
        )
    print(
        table(
            (
                "case",
                "units x batches",
                "options",
                "makespan (24 units: ideal 12, fixed 24; 2 epochs: 22)",
                "units A/B/C/D",
                "not once",
            ),
            rows,
        )
    )
    for line in verdicts(figures):
        print(line)
    emit(figures)
    return figures


if __name__ == "__main__":
    main()
