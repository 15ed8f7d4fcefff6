"""How long a training loop waits for data when loading is faster than training.

The loop runs ``shared_queue(prefetch=8, workers=1)`` over units of 20 batches on a fresh
``LocalMailbox`` (bare, or with 20 ms / 100 ms added to every request) and simulates a training
step of ``--step-ms`` (default 50 ms) per batch; the loader needs ``--load-ms`` (default 20 ms)
per batch. Both are sleeps, like a GPU step the host waits for and a read from storage. Two
references run beside it: a plain ``DataLoader(num_workers=1, prefetch_factor=8)`` over the same
load (no claims), and ``shared_queue(workers=0)`` (claims and loads on a thread of this process).

- ``stall_fraction``: time spent waiting in ``next()`` after the first batch arrived / wall time
  from the first batch to the end, on the bare LocalMailbox; target < 0.01.
- ``stall_fraction_20ms``, ``stall_fraction_100ms``: the same with mailbox latency: a claim's
  round trips (2-3 requests) are hidden as long as the buffered batches (8 x 50 ms = 400 ms)
  outlast them.
- ``stall_fraction_dataloader``, ``stall_fraction_workers0``: the references; ``handoff_ms`` is
  the median wait per batch, which is what a DataLoader worker costs the loop on every batch.

Usage: ``python -m benchmarks.stall [--quick] [--steps N]``; the last line is one JSON object.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, IterableDataset

from benchmarks._common import emit, median, parser, table, verdicts
from gradientmail import Unit, unit_grid
from gradientmail.mailbox.local import LocalMailbox
from gradientmail.mailbox.wrappers import DelayedMailbox
from gradientmail.patterns.shared_queue import shared_queue

UNIT_STEPS = 20
PREFETCH = 8


@dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # "shared" or "plain"
    latency: float = 0.0
    workers: int = 1


VARIANTS = (
    Variant("shared_queue, local", "shared"),
    Variant("shared_queue, 20ms", "shared", 0.020),
    Variant("shared_queue, 100ms", "shared", 0.100),
    Variant("DataLoader, no claims", "plain"),
    Variant("shared_queue workers=0, local", "shared", workers=0),
)
"""The figures, then two references: a plain DataLoader (the same handoff from a worker process,
no claims) and ``workers=0`` (claims and loads on a thread of this process: no handoff)."""


def load(unit: Unit, seconds: float) -> Iterator[tuple[int, torch.Tensor]]:
    for step in range(unit.first, unit.first + unit.count):
        time.sleep(seconds)  # reading the batch
        yield step, torch.full((16, 128), step, dtype=torch.int64)


class PlainUnits(IterableDataset):
    """The baseline: the same units and load through a plain DataLoader, no mailbox."""

    def __init__(self, units: dict[str, Unit], load_s: float) -> None:
        super().__init__()
        self.units, self.load_s = units, load_s

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor]]:
        for unit in self.units.values():
            yield from load(unit, self.load_s)


@contextlib.contextmanager
def open_batches(variant: Variant, units: dict[str, Unit], load_s: float):
    if variant.kind == "plain":
        iterator = iter(DataLoader(PlainUnits(units, load_s), batch_size=None, num_workers=1, prefetch_factor=PREFETCH))
        try:
            yield iterator
        finally:
            del iterator
        return
    with tempfile.TemporaryDirectory(prefix="gm-stall-") as directory:
        box = LocalMailbox(directory)
        mailbox = DelayedMailbox(box, variant.latency) if variant.latency else box
        with shared_queue(
            units,
            mailbox=mailbox,
            learner_id="bench",
            load=functools.partial(load, seconds=load_s),
            prefetch=PREFETCH,
            workers=variant.workers,
            multiprocessing_context="fork",
        ) as batches:
            yield batches


def measure(variant: Variant, steps: int, step_s: float, load_s: float) -> dict[str, float]:
    units = unit_grid(steps=steps + UNIT_STEPS, unit_steps=UNIT_STEPS, lanes=1)
    with open_batches(variant, units, load_s) as batches:
        entered = time.perf_counter()
        next(batches)
        first = time.perf_counter()
        waits = []
        for _ in range(steps - 1):
            time.sleep(step_s)  # the training step
            start = time.perf_counter()
            next(batches)
            waits.append(time.perf_counter() - start)
        time.sleep(step_s)  # the last batch's step
        end = time.perf_counter()
    return {
        "stall_fraction": sum(waits) / (end - first),
        "waited_s": sum(waits),
        "median_wait_s": median(waits),
        "longest_wait_s": max(waits),
        "wall_s": end - first,
        "first_batch_s": first - entered,
    }


def main(argv: list[str] | None = None) -> dict[str, float]:
    options = parser(__doc__)
    options.add_argument("--steps", type=int, default=None, help="training steps per run (default 60, quick 12)")
    options.add_argument("--step-ms", type=float, default=50.0, help="simulated training step (ms)")
    options.add_argument("--load-ms", type=float, default=20.0, help="simulated load per batch (ms)")
    args = options.parse_args(argv)
    steps = args.steps or (12 if args.quick else 60)
    if args.load_ms >= args.step_ms:
        options.error("--load-ms must be below --step-ms (a loader slower than training always stalls)")
    # Warm up (the first DataLoader of a process starts its helper threads), untimed.
    measure(VARIANTS[0], 5, args.step_ms / 1e3, args.load_ms / 1e3)
    results = {variant.name: measure(variant, steps, args.step_ms / 1e3, args.load_ms / 1e3) for variant in VARIANTS}

    print(
        f"Stall: training step {args.step_ms:g} ms, load {args.load_ms:g} ms per batch, {steps} steps, "
        f"units of {UNIT_STEPS} batches, prefetch {PREFETCH}{' (quick)' if args.quick else ''}"
    )
    rows = [
        [
            name,
            f"{result['stall_fraction']:.4f}",
            f"{result['waited_s'] * 1e3:.1f}",
            f"{result['median_wait_s'] * 1e3:.2f}",
            f"{result['longest_wait_s'] * 1e3:.1f}",
            f"{result['wall_s']:.2f}",
            f"{result['first_batch_s'] * 1e3:.0f}",
        ]
        for name, result in results.items()
    ]
    print(
        table(
            ["variant", "stall fraction", "waited ms", "median wait ms", "longest wait ms", "wall s", "first batch ms"],
            rows,
        )
    )
    print(
        "a wait of about the median on every batch is the DataLoader handing a batch over from its "
        "worker process (compare the plain DataLoader); a claim the buffer cannot hide shows as a "
        "longest wait near the claim's round trips"
    )
    figures = {
        "stall_fraction": results["shared_queue, local"]["stall_fraction"],
        "stall_fraction_20ms": results["shared_queue, 20ms"]["stall_fraction"],
        "stall_fraction_100ms": results["shared_queue, 100ms"]["stall_fraction"],
        "stall_fraction_dataloader": results["DataLoader, no claims"]["stall_fraction"],
        "stall_fraction_workers0": results["shared_queue workers=0, local"]["stall_fraction"],
        "handoff_ms": results["shared_queue, local"]["median_wait_s"] * 1e3,
        "step_ms": args.step_ms,
        "load_ms": args.load_ms,
    }
    for line in verdicts({"stall_fraction": figures["stall_fraction"]}):
        print(line)
    emit(figures)
    return figures


if __name__ == "__main__":
    main()
