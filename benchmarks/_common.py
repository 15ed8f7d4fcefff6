"""What every benchmark script shares: its command line, its table, its targets, its JSON line.

Kept free of torch and of ``gradientmail`` so that ``python -m benchmarks`` can read the targets
without importing what the scripts measure.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import multiprocessing
import os
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Target:
    """A figure's goal: ``value <op> bound``, with what the figure means (for tables and README)."""

    op: str  # "<=", "<" or ">="
    bound: float
    meaning: str

    def met(self, value: float) -> bool:
        if self.op == "<=":
            return value <= self.bound
        if self.op == "<":
            return value < self.bound
        if self.op == ">=":
            return value >= self.bound
        raise ValueError(f"unknown comparison {self.op!r}")

    def text(self) -> str:
        return f"{self.op} {self.bound:g}"


TARGETS: dict[str, Target] = {
    "shared_over_bound": Target("<=", 1.02, "shared-queue makespan / fluid lower bound, 64 nodes"),
    "requests_per_claim": Target("<=", 2.3, "mailbox requests per claimed unit, 100k units, 64 learners, rotation"),
    "requests_per_claim_no_rotation": Target(
        "<=", 2.5, "the same in the mapping's order (every node wants the same unit)"
    ),
    "conflicts_per_claim": Target("<=", 0.02, "lost claims per claimed unit, same run"),
    "small_units_makespan": Target(
        "<=", 13.0, "the documented case in 4 processes, one-batch units, shared_queue's defaults: time units"
    ),
    "small_units_fastest": Target(">=", 10.0, "units the fastest node trained in those runs (fewest of the repeats)"),
    "small_units_makespan_workers0": Target("<=", 13.0, "the same with prefetch=2, workers=0: time units"),
    "demo_units_makespan": Target("<=", 12.3, "the same with 4 batches a unit (the demo's units and options)"),
    "small_units_over_bound_240": Target("<=", 1.1, "240 one-batch units, the defaults: makespan / fluid bound"),
    "conflicts_per_claim_threads": Target(
        "<=", 0.01, "lost claims per claimed unit, 64 threads racing for real, rotation"
    ),
    "ratio_local": Target(
        ">=", 0.98, "shared_queue / plain DataLoader batches/s, LocalMailbox (worse of small, large)"
    ),
    "ratio_latency_20ms": Target(">=", 0.95, "the same with 20 ms per mailbox request"),
    "ratio_latency_100ms": Target(">=", 0.90, "the same with 100 ms per mailbox request"),
    "ratio_s3_20ms": Target(
        ">=", 0.95, "the same on S3Mailbox over HTTP (moto behind a proxy adding 20 ms per request)"
    ),
    "stall_fraction": Target("<", 0.01, "share of wall time the training loop waits for data, after the first batch"),
    "step_overhead": Target("<", 0.01, "Session.step with nothing due / one training step"),
    "lease_fold_rate": Target(
        ">=", 0.9, "Session folds/s with lease= / without: one-batch units, a store 20 ms away, 4 fragments"
    ),
    "lease_exit_ratio": Target("<=", 1.5, "seconds to leave the documented loop's block with lease= / without"),
    "drag": Target(">=", 0.95, "consensus advance per node step in the toy (no progress lost)"),
    "read_per_exchange": Target("<=", 3.0, "model sizes read per node per exchange at 4, 16, 64 learners"),
    "loss_over_ddp": Target("<=", 1.02, "consensus validation loss / DDP's at equal samples"),
    "time_to_ddp_loss": Target("<=", 0.60, "wall time to DDP's final loss / DDP's wall time"),
    "makespan_over_ddp": Target("<=", 0.55, "one pass: makespan / DDP's"),
    "pass_loss_over_ddp": Target(
        "<=", 1.035, "one pass, exchanges at ~25 local steps of the fastest node: consensus loss / DDP's"
    ),
    "long_loss_over_ddp": Target(
        "<=", 1.01, "`training --long` (4x the units), ~25 local steps per exchange: consensus loss / DDP's"
    ),
    "long_time_to_ddp_loss": Target("<=", 0.65, "the same run: wall time to DDP's final loss / DDP's wall time"),
    "int8_loss_over_float32": Target(
        "<=", 1.003, "the default outer over a simulated 8-bit wire: loss / the same over float32"
    ),
    "long_makespan_over_ddp": Target("<=", 0.50, "the same run, one pass of the long data: makespan / DDP's"),
    "shared_over_bound_1m": Target("<=", 1.05, "shared-queue makespan / fluid bound, 1M units, 1,024 nodes"),
    "sim_wall_s_1m": Target("<", 120.0, "wall seconds of the 1M-unit, 1,024-node simulation itself"),
    "sim_wall_s_1m_estimate": Target("<", 120.0, "the same, extrapolated from smaller runs"),
    "scale_exchange_rate_64": Target(
        ">=", 0.8, "completed / intended exchanges, slowest of 64 learners on an S3-like store (session_scale)"
    ),
    "scale_lag_intervals_64": Target(
        "<=", 2.0, "progress not yet in the run at the window's end, exchange intervals, worst of 64 learners"
    ),
    "scale_read_per_exchange_64": Target("<=", 3.0, "model sizes read per learner per exchange, 64 learners"),
    "scale_written_per_exchange_64": Target("<=", 2.0, "model sizes written per learner per exchange, 64 learners"),
    **{
        name: target
        for count in (64, 128)
        for name, target in {
            f"processes_exchange_rate_{count}": Target(
                ">=", 0.9, f"completed / intended exchanges, slowest of {count} learners in 8 processes"
            ),
            f"processes_lag_intervals_{count}": Target(
                "<=", 2.0, f"progress not yet in the run at the window's end, intervals, worst of {count} learners"
            ),
            f"processes_read_per_exchange_{count}": Target(
                "<=", 2.5, f"model sizes read per learner per exchange, {count} learners in 8 processes"
            ),
            f"processes_exact_{count}": Target(
                ">=", 1.0, f"1 when every sample is in the run exactly once after the exits, {count} learners"
            ),
        }.items()
    },
    **{
        f"local_two_over_one_{order}_{size}": Target(
            "<=", 0.6, f"LocalMailbox, 1-batch units, no training: 2 nodes' wall time / 1 node's, {size} units, {words}"
        )
        for order, words in (("mapping", "the mapping's order"), ("rotated", "rotated_order"))
        for size in ("10k", "40k", "100k")
    },
    "groups_makespan_over_ddp": Target(
        "<=",
        0.6,
        "training --groups: 2 machines of 2 processes (DDP inside) at speeds 1:1:2:2, makespan / DDP's over all 4",
    ),
    "groups_read_per_machine": Target("<=", 1.1, "the same: model sizes a machine reads per exchange interval"),
    "groups_written_per_machine": Target("<=", 1.1, "the same: model sizes a machine writes per exchange interval"),
    "shards_makespan_ours": Target(
        "<=", 13.0, "the documented case on 24 Parquet files (shards(), ParquetReader, shared_queue): time units"
    ),
    "shards_not_once_ours": Target("<=", 0.0, "rows of those files read twice or never, 4 processes"),
    "shards_read_ratio_parquet": Target(">=", 0.9, "ParquetReader rows/s / pyarrow's own, whole files"),
    "shards_read_ratio_parquet_split": Target(">=", 0.9, "ParquetReader rows/s / pyarrow's own, files split by rows"),
    "shards_read_ratio_jsonl": Target(">=", 0.9, "JsonLinesReader rows/s / pyarrow's own"),
    "shards_epoch2_bytes_fetched": Target("<=", 0.0, "bytes a second epoch fetches from the store with a ShardCache"),
    "group_step_ratio": Target("<", 0.01, "Session.step in a group, amortised over its word steps / one training step"),
    "shard_step_ratio": Target("<", 0.01, "the same in a group sharded with FSDP2"),
    "faults_lost": Target("<=", 0.0, "samples missing from the model after kill-and-restart trials"),
    "faults_doubled": Target("<=", 0.0, "samples the model holds twice after kill-and-restart trials"),
    "scale_errors_64": Target("<=", 0.0, "exceptions raised by the 64 learners' sessions (enter, step, wait, exit)"),
    **{
        name: target
        for count in (256, 1024, 4096)
        for name, target in {
            f"session_sim_exchange_rate_{count}": Target(
                ">=",
                0.95,
                f"completed / intended exchanges, slowest of {count} learners, 1B bf16 on S3 (virtual clock)",
            ),
            f"session_sim_lag_intervals_{count}": Target(
                "<=", 2.0, f"progress not yet in the run, in intervals, worst of {count} learners (virtual clock)"
            ),
            f"session_sim_versions_lag_intervals_{count}": Target(
                "<=",
                2.0,
                f"progress not yet in the fragments' newest versions (what nodes read), worst of {count} learners",
            ),
            f"session_sim_read_per_exchange_{count}": Target(
                "<=", 2.5, f"model sizes read per learner per exchange, {count} learners (virtual clock)"
            ),
            f"session_sim_written_per_exchange_{count}": Target(
                "<=", 1.5, f"model sizes written per learner per exchange, {count} learners (virtual clock)"
            ),
            f"session_sim_reads_per_s_{count}": Target(
                "<=", 5500.0, f"reads in the busiest second of the busiest prefix, {count} learners (S3's limit)"
            ),
            f"session_sim_writes_per_s_{count}": Target(
                "<=", 3500.0, f"writes in the busiest second of the busiest prefix, {count} learners (S3's limit)"
            ),
            f"session_sim_exact_{count}": Target(
                ">=", 1.0, f"1 when every sample is in the run exactly once after the exits, {count} learners"
            ),
        }.items()
    },
}
"""The targets, by figure name (the figures every script names in its JSON line)."""


def parallel_map(function: Callable[[Any], Any], items: Sequence[Any], jobs: int) -> list[Any]:
    """``[function(item) for item in items]`` in ``jobs`` fresh processes (spawn, not fork: the
    parent has imported torch). ``function`` must be a module-level function."""
    if jobs <= 1 or len(items) <= 1:
        return [function(item) for item in items]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(jobs, len(items)), mp_context=context) as pool:
        return list(pool.map(function, items))


def default_jobs() -> int:
    return max(1, min(2, os.cpu_count() or 1))


def parser(doc: str | None) -> argparse.ArgumentParser:
    """The command line every script shares: ``--quick`` (CI: runs everything, judges nothing)."""
    first = (doc or "").strip().splitlines()[0] if doc else None
    result = argparse.ArgumentParser(description=first)
    result.add_argument(
        "--quick",
        action="store_true",
        help="small sizes and few repeats, for CI: it runs every code path, its figures are noisy",
    )
    return result


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    cells = [[str(cell) for cell in row] for row in rows]
    widths = [len(header) for header in headers]
    for row in cells:
        for column, cell in enumerate(row):
            widths[column] = max(widths[column], len(cell))

    def line(row: Sequence[str]) -> str:
        parts = [
            cell.ljust(widths[column]) if column == 0 else cell.rjust(widths[column]) for column, cell in enumerate(row)
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(list(headers)), rule, *(line(row) for row in cells)])


def verdicts(figures: Mapping[str, float]) -> list[str]:
    """One line per figure of ``figures`` that has a target: value, target, met or MISSED."""
    lines = []
    for name, value in figures.items():
        target = TARGETS.get(name)
        if target is not None:
            state = "met" if target.met(value) else "MISSED"
            lines.append(f"target {name} {target.text()}: {value:.4g} {state}")
    return lines


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def emit(figures: Mapping[str, Any]) -> None:
    """Print the figures as ONE JSON object on the last line (floats rounded to 6 places)."""

    def clean(value: Any) -> Any:
        if isinstance(value, float):
            return round(value, 6) if math.isfinite(value) else None
        if isinstance(value, (list, tuple)):
            return [clean(item) for item in value]
        return value

    print(json.dumps({name: clean(value) for name, value in figures.items()}), flush=True)
