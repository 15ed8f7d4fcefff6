"""Run every benchmark, print each one's table, then merge their figures into ``results.json``.

Usage: ``python -m benchmarks [--quick] [--full] [--only NAME ...] [--output PATH]``. ``--full``
adds the training benchmark (about 6 minutes: real training in four processes, three repeats)
and the scale benchmark (3 to 4 minutes: up to 256k units over 256 nodes on the virtual clock,
extrapolated to 1M units over 1,024 nodes).
Each script runs in
its own process, one after another (the timing ones must not share the cores with the others).
A run merges into ``benchmarks/results.json`` (``benchmarks.results``): each script it ran
replaces its own entry, with its command, date and machine; the others keep theirs. It then
renders ``benchmarks/RESULTS.md`` and the figure blocks of the README and ``docs/`` from that file
(``benchmarks.figures``). ``--quick`` writes nothing unless ``--output`` is given. The last line
printed is one JSON object: every script's figures by name, and the wall time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import figures, results
from benchmarks.results import RESULTS_JSON, Run

SCRIPTS = (
    "balance",
    "small_units",
    "requests",
    "epochs",
    "throughput",
    "stall",
    "session",
    "session_lease",
    "session_figures",
)
"""What ``python -m benchmarks`` runs (within its budget, ``BUDGET_S``)."""
FULL_SCRIPTS = (
    *SCRIPTS,
    "orders",
    "shards",
    "s3_latency",
    "training",
    "scale",
    "session_scale",
    "session_sim",
    "session_processes",
    "faults",
    "local_scale",
    "group_step",
    "shard_step",
)
"""What ``--full`` runs: also the cost of each preference order at 20k and 100k units (``orders``,
about a minute on the virtual clock), the shards benchmark (the documented case on Parquet files against
litdata and MosaicML streaming where their environment is installed, readers' throughput, a
second epoch's bytes: about 3 minutes), the S3 end-to-end row (a moto server and a latency proxy on the same
cores, 35 s), the model-quality benchmark, which trains for about 7 minutes, the scale benchmark
with the 1M-unit, 1,024-node simulation itself (``--direct``: about 4 minutes a run, 3 runs), and the Session at
4, 16 and 64 learners over a store with S3-like latency (``session_scale``, a few minutes), the
Session at 16 to 1,024 learners with a 1B-parameter model on S3's figures, on a virtual clock
(``session_sim``: about 40 minutes, the 1,024-learner rows on 64 and on 16 fragments and the 4,096-learner row on 512,
4 of them simulated, in processes of their own),
64 and 128 learners dealt to 8 processes on one store (``session_processes``, about 2 minutes), and
50 kill-and-restart trials on node processes (``faults``: samples lost or doubled in the model,
about a minute), and two node processes against one on a ``LocalMailbox`` (``local_scale --large``:
10k, 40k and 100k 1-batch units in both orders, three pairs each, about 15 minutes), and what
``Session.step`` costs in a group of two gloo processes, DDP inside (``group_step``) and FSDP2
(``shard_step``), about a minute each."""
FULL_OPTIONS: dict[str, tuple[str, ...]] = {
    "scale": ("--direct", "--repeats", "3"),
    "requests": ("--repeats", "3"),
    "local_scale": ("--large",),
    "session_sim": (
        "--learners",
        "16",
        "64",
        "256",
        "1024",
        "4096",
        "--fragments",
        "16",
        "16",
        "16",
        "64",
        "512",
        "--simulate",
        "16",
        "16",
        "16",
        "64",
        "4",
        "--also",
        "1024:16",
        "1024:64:4",
        "256:16:4",
    ),
}
"""Options a script gets in a full (not ``--quick``) run: the 1M rows are measured, not estimated."""

WITH_FULL: dict[str, tuple[str, ...]] = {"throughput": ("--disk",)}
"""Options a script gets only with ``--full``: rows without a target that the default run leaves
out to stay within its 8 minutes."""

SUMMARY: tuple[tuple[str, str, str], ...] = (
    ("balance", "shared_over_bound", "shared-queue makespan / fluid bound, 64 nodes, 10k units"),
    ("balance", "fixed_over_bound", "fixed split (DistributedSampler-style) makespan / fluid bound, same"),
    ("balance", "shared_over_bound_256", "shared queue / bound, 256 nodes"),
    ("balance", "shared_over_bound_slowdown", "shared queue / bound, 64 nodes, one 4x slower halfway"),
    ("balance", "fixed_over_bound_slowdown", "fixed split / bound, same slowdown"),
    ("small_units", "small_units_makespan", "the documented case, 4 processes, one-batch units, defaults (ideal 12)"),
    ("small_units", "small_units_fastest", "units the fastest node trained, same runs (ideal 11)"),
    ("small_units", "small_units_makespan_workers0", "the same with prefetch=2, workers=0"),
    ("small_units", "demo_units_makespan", "the same with 4 batches a unit, the demo's options"),
    ("small_units", "small_units_over_bound_240", "240 one-batch units, defaults: makespan / fluid bound"),
    ("small_units", "epochs_makespan", "the documented case over 2 epochs as one run (epochs()), defaults (ideal 22)"),
    ("shards", "shards_makespan_ours", "the documented case on 24 Parquet files, 4 processes: ours (ideal 12)"),
    ("shards", "shards_makespan_litdata", "the same with litdata's StreamingDataset (where --peers installed it)"),
    ("shards", "shards_makespan_streaming", "the same with MosaicML streaming's StreamingDataset (likewise)"),
    ("shards", "shards_not_once_ours", "rows read twice or never, ours"),
    ("shards", "shards_read_ratio_parquet", "ParquetReader / pyarrow rows per second, whole files"),
    ("shards", "shards_read_cpu_ratio_parquet", "the same per second of CPU time (steadier on a busy machine)"),
    ("shards", "shards_read_ratio_parquet_split", "the same, files split by rows (split=)"),
    ("shards", "shards_read_cpu_ratio_parquet_split", "the same per second of CPU time"),
    ("shards", "shards_read_ratio_jsonl", "JsonLinesReader / pyarrow rows per second"),
    ("shards", "shards_read_ratio_litdata", "litdata's reader on its own format / pyarrow rows per second"),
    ("shards", "shards_epoch2_bytes_fetched", "bytes the second epoch fetches from the bucket with a ShardCache"),
    ("requests", "requests_per_claim", "mailbox requests per claimed unit, 100k units, 64 learners, rotation"),
    ("requests", "conflicts_per_claim", "lost claims per claimed unit, same (virtual clock: atomic steps)"),
    ("requests", "requests_per_claim_threads", "requests per claim, 64 threads racing for real, rotation"),
    ("requests", "conflicts_per_claim_threads", "lost claims per claim, same"),
    ("requests", "conflicts_per_claim_threads_no_rotation", "lost claims per claim, same without rotation"),
    ("orders", "orders_requests_per_claim_default_64", "requests per claim, rotated_order's defaults, 64 learners"),
    ("orders", "orders_step_spread_default_64", "groups of steps between the nodes' units at one moment, same"),
    ("orders", "orders_requests_per_claim_mapping_64", "requests per claim, every node in the mapping's order"),
    ("orders", "orders_step_spread_mapping_64", "groups of steps between the nodes' units at one moment, same"),
    (
        "epochs",
        "epochs_requests_per_claim",
        "requests per claim, 16 nodes, 2 shuffled epochs (epochs()), virtual clock",
    ),
    ("epochs", "epochs_plain_keys_requests_per_claim", "the same order under plain e0000/{id} keys"),
    ("epochs", "mix_requests_per_claim", "requests per claim, a 90/10 mixture (mix()), same nodes"),
    ("epochs", "mix_plain_keys_requests_per_claim", "the same order under plain {source}/{id} keys"),
    ("throughput", "ratio_local", "shared_queue / plain DataLoader batches/s, LocalMailbox in tmpfs, loader-bound"),
    ("throughput", "ratio_disk", "the same, LocalMailbox on this machine's disk (0.8 ms a file create; --full)"),
    ("throughput", "ratio_latency_20ms", "the same (tmpfs), 20 ms per mailbox request"),
    ("throughput", "ratio_latency_100ms", "the same, 100 ms per mailbox request"),
    ("s3_latency", "ratio_s3_20ms", "the same on S3Mailbox: moto over HTTP behind a 20 ms-per-request proxy"),
    ("stall", "stall_fraction", "share of time the loop waits for data, 50 ms step, 20 ms load, LocalMailbox"),
    ("stall", "stall_fraction_dataloader", "the same for a plain DataLoader (num_workers=1), no claims"),
    ("stall", "stall_fraction_workers0", "the same for shared_queue(workers=0)"),
    ("session", "step_overhead", "Session.step, nothing due / one training step of a small MLP"),
    ("session", "step_overhead_exchange", "Session.step that starts an exchange / one training step"),
    (
        "session_lease",
        "lease_fold_rate",
        "Session folds/s with lease= / without, one-batch units, 20 ms store, 4 fragments",
    ),
    (
        "session_lease",
        "lease_exit_ratio",
        "seconds to leave the documented loop's block with lease= / without, same runs",
    ),
    ("session_figures", "drag", "consensus advance per node step, the toy: 4 equal nodes, staggered exchanges"),
    ("session_figures", "read_per_exchange", "model sizes a node reads per exchange, worst of 4, 16, 64 learners"),
    ("session_scale", "scale_exchange_rate_64", "exchanges per learner / intended, worst of 64 threads, S3-like store"),
    ("session_scale", "scale_lag_intervals_64", "progress not yet in the run at the end, in intervals, worst learner"),
    ("session_scale", "scale_read_per_exchange_64", "model sizes read per learner per exchange, 64 learners"),
    ("session_scale", "scale_written_per_exchange_64", "model sizes written per learner per exchange, 64 learners"),
    ("session_scale", "scale_errors_64", "learner errors, 64 learners"),
    *(
        ("session_processes", f"processes_{figure}_{count}", f"{words}, {count} learners in 8 processes")
        for count in (64, 128)
        for figure, words in (
            ("exchange_rate", "completed / intended exchanges, slowest learner"),
            ("lag_intervals", "progress not yet in the run, intervals, worst learner"),
            ("read_per_exchange", "model sizes read per learner per exchange"),
        )
    ),
    (
        "session_scale",
        "scale_conflicts_per_exchange_64",
        "fragment folds lost to a rival's create per exchange, 64 learners",
    ),
    *(
        (
            "local_scale",
            f"local_two_over_one_{order}_{size}",
            f"2 nodes / 1 node wall time, LocalMailbox, {size} units, {words}",
        )
        for order, words in (("mapping", "the mapping's order"), ("rotated", "rotated_order"))
        for size in ("10k", "40k", "100k")
    ),
    *(
        (
            "local_scale",
            f"local_cpu_floor_{order}_{size}",
            f"the lowest 2/1 ratio the two nodes' CPU seconds allow on this machine's cores, {size}, {order}",
        )
        for order in ("mapping", "rotated")
        for size in ("10k", "40k", "100k")
    ),
    ("local_scale", "local_list_page_ms_100k", "ms to list 1,000 keys after a key, LocalMailbox of 100k claims"),
    *(
        (
            "session_sim",
            f"session_sim_{figure}_{count}",
            f"{words}, {count} learners, 1B bf16 every 60 s on S3, virtual clock",
        )
        for count in (256, 1024, 4096)
        for figure, words in (
            ("exchange_rate", "completed / intended exchanges, slowest learner"),
            ("lag_intervals", "progress not yet in the run, intervals, worst learner"),
            ("versions_lag_intervals", "progress not yet in the newest versions (what nodes read), worst learner"),
            ("read_per_exchange", "model sizes read per learner per exchange"),
            ("written_per_exchange", "model sizes written per learner per exchange"),
            ("reads_per_s", "reads per second on the busiest prefix (S3: 5,500)"),
            ("writes_per_s", "writes per second on the busiest prefix (S3: 3,500)"),
        )
    ),
    ("group_step", "group_step_ratio", "Session.step in a group of 2 (DDP, gloo), amortised / one training step"),
    ("shard_step", "shard_step_ratio", "the same for a group of 2 sharded with FSDP2 (gloo)"),
    (
        "shard_step",
        "written_models_per_interval",
        "model sizes one rank of that sharded group writes per exchange interval (its shard)",
    ),
    ("faults", "faults_lost", "samples missing from the model after 50 kill-and-restart trials"),
    ("faults", "faults_doubled", "samples the model holds twice, same trials"),
    (
        "training",
        "pass_loss_over_ddp",
        "validation loss of the consensus / DDP's, one pass, 4 nodes at speeds 1:2:2:4, ~25 local steps per exchange",
    ),
    ("training", "time_to_ddp_loss", "wall time until the consensus reaches DDP's final loss / DDP's wall time"),
    ("training", "makespan_over_ddp", "one pass: last node done / DDP's makespan"),
    ("training", "loss_over_single", "validation loss of the consensus / one node trained on all the data"),
    (
        "scale",
        "shared_over_bound_1m",
        "shared queue / bound, 1M units, 1,024 nodes (only with `benchmarks.scale --direct`)",
    ),
    ("scale", "requests_per_claim_1m", "requests per claim, same (only with `--direct`)"),
    ("scale", "sim_wall_s_1m_estimate", "wall s of the 1M-unit, 1,024-node simulation, extrapolated from the ladder"),
    ("scale", "node_startup_s_1m", "one simulated node's start-up at 1M units (order, claimer, fingerprint), s"),
    ("scale", "memory_mb_per_node_1m", "MB one simulated node keeps at 1M units (tracemalloc; claim index shared)"),
    ("scale", "shared_over_bound_ladder", "shared queue / bound at the largest simulated size (256k units, 256 nodes)"),
    ("scale", "requests_per_claim_ladder", "requests per claim, same"),
    ("scale", "claim_loop_us_1m", "claim loop microseconds per claim, extrapolated to 1,024 nodes"),
)
"""The figures the summary table shows, with what each means; targets come from ``TARGETS``."""

DESCRIBED: dict[tuple[str, str], str] = {
    ("training_long", "average_long_loss_over_ddp"): "the same with outer=average",
    ("training_long", "bfloat16_long_loss_over_ddp"): "the same with the default and bfloat16 state",
    ("training_long", "average_long_time_to_ddp_loss"): "the same run: wall time to DDP's final loss / DDP's, average",
    ("training_groups", "groups_loss_over_ddp"): "2 groups of 2 (DDP inside): consensus loss / DDP's over all 4",
    ("training_groups", "learners_loss_over_ddp"): "4 learners of one process (two per machine): the same",
    ("training_groups", "learners_makespan_over_ddp"): "4 learners of one process: makespan / DDP's",
    ("training_groups", "learners_read_per_machine"): "4 learners of one process: model sizes a machine reads",
    ("training_groups", "learners_written_per_machine"): "4 learners of one process: model sizes a machine writes",
}
"""What the figures that pages name mean where neither ``SUMMARY`` nor a target says (entries
that a script's option writes, such as ``training --long``); they are shown only where named."""

BUDGET_S = 480.0


@dataclass
class Outcome:
    name: str
    returncode: int
    seconds: float
    lines: list[str] = field(default_factory=list)
    figures: dict | None = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.figures is not None


def script_command(name: str, quick: bool, full: bool = False) -> list[str]:
    """The command that runs benchmark ``name`` (quick: ``--quick``; else its ``FULL_OPTIONS``,
    and with ``full`` its ``WITH_FULL`` options too)."""
    options = ["--quick"] if quick else [*FULL_OPTIONS.get(name, ()), *(WITH_FULL.get(name, ()) if full else ())]
    return [sys.executable, "-m", f"benchmarks.{name}", *options]


def run_script(name: str, quick: bool, full: bool = False) -> Outcome:
    command = script_command(name, quick, full)
    print(f"$ python {' '.join(command[1:])}", flush=True)
    start = time.perf_counter()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, text=True, bufsize=1, cwd=Path(__file__).resolve().parent.parent
    )
    assert process.stdout is not None
    lines = []
    for line in process.stdout:
        print(line, end="", flush=True)
        lines.append(line.rstrip("\n"))
    returncode = process.wait()
    outcome = Outcome(name, returncode, time.perf_counter() - start, lines)
    if lines:
        try:
            parsed = json.loads(lines[-1])
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            outcome.figures = parsed
            outcome.lines = lines[:-1]
    print(
        f"({name}: {outcome.seconds:.1f}s{'' if outcome.ok else f', FAILED with exit code {returncode}'})\n", flush=True
    )
    return outcome


def machine() -> str:
    """This machine in a few words, with its load when the run began (shared cores move the timings)."""
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # pragma: no cover - torch is a dependency
        torch_version = "?"
    try:
        load = f", load average {os.getloadavg()[0]:.1f} at the start"
    except OSError:  # pragma: no cover - no load average on this platform
        load = ""
    return (
        f"{os.cpu_count()} CPUs ({platform.machine()}), Python {platform.python_version()}, "
        f"torch {torch_version}, {platform.system()}{load}"
    )


def runs_of(outcomes: dict[str, Outcome], quick: bool, full: bool) -> dict[str, Run]:
    """The results-file entries of the scripts that succeeded: each with its own command."""
    where, today = machine(), datetime.date.today().isoformat()
    return {
        name: Run(
            command="python " + " ".join(script_command(name, quick, full)[1:]),
            date=today,
            machine=where,
            figures=outcome.figures or {},
            seconds=round(outcome.seconds, 1),
            lines=outcome.lines,
        )
        for name, outcome in outcomes.items()
        if outcome.ok
    }


def in_script_order(runs: dict[str, Run]) -> dict[str, Run]:
    """``runs`` in ``FULL_SCRIPTS``' order, an entry such as ``training_long`` after its script."""

    def rank(name: str) -> tuple[int, str]:
        owners = [script for script in FULL_SCRIPTS if name == script or name.startswith(script + "_")]
        owner = max(owners, key=len, default=None)
        return (FULL_SCRIPTS.index(owner) if owner is not None else len(FULL_SCRIPTS), name)

    return dict(sorted(runs.items(), key=lambda item: rank(item[0])))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="every script in its quick mode (CI)")
    parser.add_argument(
        "--full", action="store_true", help="also the training (about 6 minutes) and scale (about 3) benchmarks"
    )
    parser.add_argument("--only", nargs="+", choices=FULL_SCRIPTS, help="run only these scripts")
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help=f"the results file to merge into (default {RESULTS_JSON.name}, which also refreshes RESULTS.md, "
        "the README and docs/; --quick: none unless given), RESULTS.md-style text beside it",
    )
    args = parser.parse_args(argv)
    output = args.output or (None if args.quick else RESULTS_JSON)
    start = time.perf_counter()
    chosen = args.only or (FULL_SCRIPTS if args.full else SCRIPTS)
    outcomes = {name: run_script(name, args.quick, args.full) for name in chosen}
    wall = time.perf_counter() - start
    fresh = runs_of(outcomes, args.quick, args.full)
    print(figures.render_all(fresh, figures.summary_meanings()))
    written = ""
    if output is not None:
        merged = in_script_order(results.merge(results.load(output), fresh))
        results.save(merged, output)
        if output.resolve() == RESULTS_JSON.resolve():
            pages = figures.write_all(merged)
        else:
            page = output.with_suffix(".md")
            page.write_text(figures.render_results_md(merged, output))
            pages = [page]
        written = f"; merged {len(fresh)} script(s) into {output}" + "".join(f", wrote {page}" for page in pages)
    over = "" if args.quick or args.full or args.only or wall <= BUDGET_S else f" (over the {BUDGET_S:.0f} s budget)"
    print(f"\n{wall:.0f}s in all{over}{written}")
    failed = [name for name, outcome in outcomes.items() if not outcome.ok]
    if failed:
        print(f"FAILED (their earlier figures kept): {', '.join(failed)}", file=sys.stderr)
    print(json.dumps({**{name: outcome.figures for name, outcome in outcomes.items()}, "wall_s": round(wall, 1)}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
