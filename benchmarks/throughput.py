"""Batches per second of ``shared_queue`` against a plain DataLoader over the same load.

Both sides read the same units (20 batches each, the design note's ``unit_steps``) with the same
``load``, which builds each batch in the worker (``torch.full``: the cost of copying it out of
a page cache, no disk). The baseline is ``DataLoader(num_workers=1, prefetch_factor=8)`` over a
plain ``IterableDataset`` of those units, without claims; the shared queue is
``shared_queue(prefetch=8, workers=1)`` on a fresh ``LocalMailbox`` in tmpfs (``MEMORY_DIR``;
``disk``: in the temp directory), bare or behind a ``DelayedMailbox`` adding 20 ms or 100 ms to
every request (a slow S3). The loop consumes batches as fast as they come, so the loader and
the hand-over keep both cores busy: these ratios are the worst case, and a training step longer
than the claim's round trips hides them (see ``benchmarks.stall``).

A rate is measured over whole units, from the first batch of the fourth unit to the first batch
of the last one (claims included; start-up and a warm-up of ``WARMUP_UNITS`` units, shown in the
table, excluded on both sides), for ``--seconds`` per run. Every repeat
runs the baseline and the shared-queue variants back to back in a rotated order, in this one
process (the 100 ms variant, which has no target, in every other repeat); a rate is the median
over repeats, and a ratio the median over repeats of shared / baseline within the repeat: this
machine's rates drift by +-20 % between runs, so it takes eight pairs or more to pin a ratio to a few %.

- ``ratio_local``: the worse of small (16x128 int64, 16 KiB) and large (256x2048 int64, 4 MiB)
  batches on a LocalMailbox; target >= 0.95.
- ``ratio_latency_20ms`` (target >= 0.90) and ``ratio_latency_100ms``: the same with latency.
- ``ratio_disk``: the worse of the two with the mailbox on disk (no target; see ``MEMORY_DIR``;
  with ``--disk``, which ``python -m benchmarks --full`` and ``--quick`` pass, to keep the default
  run of every benchmark within its 3 minutes).

The table also shows the mailbox time per claimed unit, measured where the requests run, and
the ratio that time would predict if claims were made on demand between two units (the design note's
design, ``claim_ahead=0``): ``shared_queue`` claims ahead on background threads once the loop
runs dry during claims (``gradientmail.queue.claimer``), so the measured ratio beats it.

Usage: ``python -m benchmarks.throughput [--quick] [--disk] [--repeats N] [--seconds S]``; the last line
is one JSON object.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from benchmarks._common import emit, median, parser, table, verdicts
from gradientmail import Unit, unit_grid
from gradientmail.mailbox.local import LocalMailbox
from gradientmail.mailbox.wrappers import DelayedMailbox
from gradientmail.patterns.shared_queue import shared_queue

SIZES = {"small": (16, 128), "large": (256, 2048)}
"""Batch shapes (int64): 16 KiB, and the design note's 256 sequences of 2,048 tokens (4 MiB)."""

LATENCIES = {"local": 0.0, "disk": 0.0, "20ms": 0.020, "100ms": 0.100}
SPARSE = {"disk", "100ms"}
"""Variants without a target run in every other repeat only (the 100 ms one takes seconds)."""

MEMORY_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None
"""Where the mailbox lives except for the ``disk`` variant: tmpfs, like the shared memory the
DataLoader hands batches over in, so that ``ratio_local`` measures the library, not the disk.
On this machine's ext4 disk creating a file costs about 0.8 ms of kernel CPU (tmpfs: 0.03 ms),
a third of a claim's cost is that one create, and with both cores busy loading it shows: the
``disk`` row puts the mailbox in the temp directory to show by how much."""
UNIT_STEPS = 20
PREFETCH = 8
UNITS = 2_000  # more than any run consumes: runs are bounded by time, not by the units
WARMUP_UNITS = 3
"""Units consumed before the rate is measured, on both sides: the DataLoader's worker starts, and
``claim_ahead`` finds its depth (it reacts from the second unit on, once the loop has run dry
twice); the table shows what the warm-up took."""


def load(unit: Unit, shape: tuple[int, int]) -> Iterator[tuple[int, torch.Tensor]]:
    for step in range(unit.first, unit.first + unit.count):
        yield step, torch.full(shape, step, dtype=torch.int64)


class PlainUnits(IterableDataset):
    """The baseline: every unit's batches in order, no mailbox."""

    def __init__(self, units: dict[str, Unit], shape: tuple[int, int]) -> None:
        super().__init__()
        self.units, self.shape = units, shape

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor]]:
        for unit in self.units.values():
            yield from load(unit, self.shape)


class TimedMailbox:
    """Adds up the time spent in mailbox requests and their count, across forked workers."""

    def __init__(self, inner, totals) -> None:  # totals: a shared RawArray of 2 doubles
        self.inner, self.totals = inner, totals

    @property
    def url(self) -> str:
        return f"timed+{getattr(self.inner, 'url', self.inner)}"

    def _timed(self, method: str, *args, **options):
        start = time.perf_counter()
        try:
            return getattr(self.inner, method)(*args, **options)
        finally:
            self.totals[0] += time.perf_counter() - start
            self.totals[1] += 1

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self._timed("put_if_absent", key, data)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        return self._timed("get", key, max_bytes=max_bytes)

    def put(self, key: str, data: bytes) -> None:
        self._timed("put", key, data)

    # The compare-and-swap of the stores measured here (a directory, S3): without it the queue's
    # default would be the design note's queue, not what those stores run.
    def get_versioned(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, str] | None:
        return self._timed("get_versioned", key, max_bytes=max_bytes)

    def replace_if(self, key: str, data: bytes, version: str) -> bool:
        return self._timed("replace_if", key, data, version)

    def delete(self, key: str) -> None:
        self._timed("delete", key)

    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        # Read whole (every page's latency counted); one listing counts as one request here.
        start = time.perf_counter()
        try:
            keys = [*self.inner.list(prefix, start_after)]
        finally:
            self.totals[0] += time.perf_counter() - start
            self.totals[1] += 1
        return iter(keys)


@dataclass
class Run:
    rate: float  # batches/s over whole units
    units: int  # units the rate covers
    first_batch_s: float  # start-up: entering the loop to the first batch
    warmup_s: float  # the first WARMUP_UNITS units
    mailbox_wait_per_unit_s: float = float("nan")  # time in mailbox requests per claim
    requests_per_unit: float = float("nan")


def consume(batches: Iterator[tuple[int, torch.Tensor]], seconds: float) -> tuple[float, int, float, float]:
    """(batches/s, units) over whole units after the warm-up, for about ``seconds``; and the
    seconds to the first batch and of the warm-up."""
    entered = time.perf_counter()
    first = start = None
    unit_starts = 0
    last_start = entered
    for step, _batch in batches:
        if step % UNIT_STEPS == 0:  # the first batch of a unit
            now = time.perf_counter()
            if first is None:
                first = now
            unit_starts += 1
            if unit_starts == WARMUP_UNITS + 1:
                start = now
            last_start = now
            if start is not None and now - start >= seconds and unit_starts >= WARMUP_UNITS + 3:
                break
    if first is None or start is None:
        raise RuntimeError("fewer batches than the warm-up arrived")
    units = unit_starts - 1 - WARMUP_UNITS
    return units * UNIT_STEPS / (last_start - start), units, first - entered, start - first


def run_baseline(units: dict[str, Unit], shape: tuple[int, int], seconds: float) -> Run:
    loader = DataLoader(PlainUnits(units, shape), batch_size=None, num_workers=1, prefetch_factor=PREFETCH)
    iterator = iter(loader)
    try:
        rate, count, first, warmup = consume(iterator, seconds)
    finally:
        del iterator
    return Run(rate, count, first, warmup)


def measure_shared(
    units: dict[str, Unit],
    shape: tuple[int, int],
    box: Any,
    seconds: float,
    around: Callable[[], Any] | None = None,
    claims_on: Any = None,
) -> tuple[Run, tuple[Any, Any]]:
    """One ``shared_queue`` run over ``box`` (timed per request); ``around`` is called just before
    and just after the measured loop (its two results are returned beside the run); claims are
    counted afterwards on ``claims_on`` (default ``box``: pass the store under a delay)."""
    totals = multiprocessing.RawArray("d", 2)  # seconds in requests, requests; shared by fork
    timed = TimedMailbox(box, totals)
    with shared_queue(
        units,
        mailbox=timed,
        learner_id="bench",
        load=functools.partial(load, shape=shape),
        prefetch=PREFETCH,
        workers=1,
        multiprocessing_context="fork",
    ) as batches:
        # Start-up requests (store check, run.json) ran here, in this process; reset.
        totals[0] = totals[1] = 0.0
        before = around() if around else None
        rate, count, first, warmup = consume(batches, seconds)
        after = around() if around else None
    claimed = sum(1 for _ in (claims_on or box).list("units/"))
    run = Run(rate, count, first, warmup, totals[0] / max(1, claimed), totals[1] / max(1, claimed))
    return run, (before, after)


def run_shared(
    units: dict[str, Unit], shape: tuple[int, int], latency: float, seconds: float, directory: str | None = MEMORY_DIR
) -> Run:
    with tempfile.TemporaryDirectory(prefix="gm-bench-", dir=directory) as directory:
        inner = LocalMailbox(directory)
        box = DelayedMailbox(inner, latency) if latency else inner
        return measure_shared(units, shape, box, seconds, claims_on=inner)[0]


@dataclass
class Config:
    size: str
    latency: str | None  # None: the baseline
    runs: list[Run] = field(default_factory=list)
    repeats: list[int] = field(default_factory=list)  # the repeat each run belongs to

    @property
    def rate(self) -> float:
        return median(run.rate for run in self.runs)

    @property
    def label(self) -> str:
        return "DataLoader, no claims" if self.latency is None else f"shared_queue, {self.latency}"


def main(argv: list[str] | None = None) -> dict[str, float]:
    options = parser(__doc__)
    options.add_argument(
        "--repeats", type=int, default=None, help="runs of each variant (default 6, quick 1; disk, 100 ms: every other)"
    )
    options.add_argument("--seconds", type=float, default=None, help="seconds per run (default 0.8, quick 0.2)")
    options.add_argument(
        "--disk", action="store_true", help="also the mailbox on disk (ratio_disk; always with --quick)"
    )
    args = options.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 6)
    seconds = args.seconds or (0.2 if args.quick else 0.8)
    torch.set_num_threads(1)
    units = unit_grid(steps=UNITS * UNIT_STEPS, unit_steps=UNIT_STEPS, lanes=1)
    names = [name for name in LATENCIES if name != "disk" or args.disk or args.quick]
    configs = {size: [Config(size, None)] + [Config(size, name) for name in names] for size in SIZES}
    start = time.perf_counter()
    for repeat in range(repeats):
        for size, variants in configs.items():
            shape = SIZES[size]
            shift = repeat % len(variants)
            for config in variants[shift:] + variants[:shift]:  # rotate who goes first
                if config.latency in SPARSE and repeat % 2:
                    continue
                config.repeats.append(repeat)
                if config.latency is None:
                    config.runs.append(run_baseline(units, shape, seconds))
                else:
                    where = None if config.latency == "disk" else MEMORY_DIR
                    config.runs.append(run_shared(units, shape, LATENCIES[config.latency], seconds, where))
    wall = time.perf_counter() - start

    print(
        f"Throughput, loader-bound: batches/s, median of {repeats} alternating runs of ~{seconds:g}s "
        f"({', '.join(sorted(SPARSE))}: every other), "
        f"units of {UNIT_STEPS} batches, prefetch {PREFETCH}, 1 worker{' (quick)' if args.quick else ''}"
    )
    rows = []
    figures: dict[str, float] = {}
    for size, variants in configs.items():
        baseline = variants[0]
        unit_load = UNIT_STEPS / baseline.rate
        for config in variants:
            # Each repeat ran both sides back to back: the median of those paired ratios cancels
            # the drift of a shared machine better than a ratio of two medians.
            ratio = median(
                run.rate / baseline.runs[repeat].rate for run, repeat in zip(config.runs, config.repeats, strict=True)
            )
            wait = median(run.mailbox_wait_per_unit_s for run in config.runs)
            requests = median(run.requests_per_unit for run in config.runs)
            predicted = unit_load / (unit_load + wait) if config.latency is not None else 1.0
            spread = f"{min(r.rate for r in config.runs):.0f}-{max(r.rate for r in config.runs):.0f}"
            rows.append(
                [
                    f"{size} {config.label}",
                    f"{config.rate:.1f}",
                    spread,
                    f"{ratio:.3f}",
                    "-" if config.latency is None else f"{requests:.2f}",
                    "-" if config.latency is None else f"{wait * 1e3:.1f}",
                    f"{unit_load * 1e3:.1f}" if config.latency is None else f"{predicted:.3f}",
                    f"{median(run.first_batch_s for run in config.runs) * 1e3:.0f}",
                    f"{median(run.warmup_s for run in config.runs) * 1e3:.0f}",
                ]
            )
            if config.latency is not None:
                key = config.latency if config.latency in ("local", "disk") else f"latency_{config.latency}"
                figures[f"ratio_{key}_{size}"] = ratio
            figures[f"batches_per_s_{size}_{'baseline' if config.latency is None else config.latency}"] = config.rate
    print(
        table(
            [
                "variant",
                "batches/s",
                "min-max",
                "ratio",
                "requests/unit",
                "mailbox ms/unit",
                "unit load ms | on demand",
                "first batch ms",
                f"{WARMUP_UNITS} units warm-up ms",
            ],
            rows,
        )
    )
    print(
        "on demand = unit load / (unit load + mailbox time per unit): the ratio if every claim's requests "
        "ran between two units (claim_ahead=0); claiming ahead overlaps them with loading. "
        f"{wall:.0f}s in all."
    )
    headline = {
        "ratio_local": min(figures["ratio_local_small"], figures["ratio_local_large"]),
        "ratio_latency_20ms": min(figures["ratio_latency_20ms_small"], figures["ratio_latency_20ms_large"]),
        "ratio_latency_100ms": min(figures["ratio_latency_100ms_small"], figures["ratio_latency_100ms_large"]),
    }
    if "ratio_disk_small" in figures:
        headline["ratio_disk"] = min(figures["ratio_disk_small"], figures["ratio_disk_large"])
    for line in verdicts(headline):
        print(line)
    emit({**headline, **figures})
    return {**headline, **figures}


if __name__ == "__main__":
    main()
