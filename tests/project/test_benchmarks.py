"""Every benchmark script runs in its quick mode and ends with its figures as one JSON line.

These tests check that the benchmarks execute and report what they promise, never how fast
anything is: CI machines are too noisy for speed bars, and the figures are judged in
``benchmarks/RESULTS.md`` instead.
"""

from __future__ import annotations

import pytest
from benchmark_runs import finite, quick_run  # tests/helpers/ is on sys.path (tests/conftest.py)

FIGURES = {
    "balance": [
        "shared_over_bound",
        "fixed_over_bound",
        "shared_over_bound_4",
        "shared_over_bound_64",
        "shared_over_bound_256",
        "fixed_over_bound_256",
        "shared_over_bound_slowdown",
        "fixed_over_bound_slowdown",
        "documented_makespan",
        "documented_fixed_makespan",
        "documented_units",
    ],
    "small_units": [
        "small_units_makespan",
        "small_units_fastest",
        "small_units_makespan_workers0",
        "demo_units_makespan",
        "small_units_over_bound_240",
        "epochs_makespan",
        "small_units_makespan_spread",
        "small_units_makespan_wrong",
    ],
    "requests": [
        "requests_per_claim",
        "conflicts_per_claim",
        "requests_per_claim_no_rotation",
        "conflicts_per_claim_no_rotation",
        "requests_per_claim_threads",
        "conflicts_per_claim_threads",
        "requests_per_claim_threads_no_rotation",
        "conflicts_per_claim_threads_no_rotation",
    ],
    "epochs": [
        "sorted_requests_per_claim",
        "epochs_requests_per_claim",
        "epochs_plain_keys_requests_per_claim",
        "mix_requests_per_claim",
        "mix_plain_keys_requests_per_claim",
    ],
    "throughput": [
        "ratio_local",
        "ratio_latency_20ms",
        "ratio_latency_100ms",
        "ratio_disk",
        "ratio_local_small",
        "ratio_local_large",
        "batches_per_s_small_baseline",
        "batches_per_s_large_baseline",
    ],
    "stall": [
        "stall_fraction",
        "stall_fraction_20ms",
        "stall_fraction_100ms",
        "stall_fraction_dataloader",
        "stall_fraction_workers0",
        "handoff_ms",
    ],
    "session": ["step_overhead", "step_overhead_exchange", "step_overhead_merge"],
    "session_lease": ["lease_fold_rate", "lease_exit_ratio", "lease_exit_s", "no_lease_exit_s"],
    "session_figures": [
        "drag",
        "read_per_exchange",
        "drag_every_1",
        "drag_every_4",
        "drag_every_16",
        "read_per_exchange_4",
        "read_per_exchange_16",
        "read_per_exchange_64",
    ],
}
SCALE = [
    "shared_over_bound_1m",
    "requests_per_claim_1m",
    "conflicts_per_claim_1m",
    "sim_wall_s_1m",
    "sim_cpu_s_1m",
    "rss_mb_per_node_1m",
    "sim_cpu_s_ladder",
    "sim_wall_s_1m_estimate",
    "sim_wall_s_1m_estimate_flat",
    "node_startup_s_1m",
    "memory_mb_per_node_1m",
    "claim_loop_us_1m",
    "shared_over_bound_ladder",
    "requests_per_claim_ladder",
    "sim_wall_s_ladder",
    "rss_mb_per_node_ladder",
]
"""``benchmarks.scale``: its quick mode simulates its (small) target directly, so every figure is a number."""
S3_LATENCY = [
    "ratio_s3_20ms",
    "ratio_s3_20ms_small",
    "ratio_s3_20ms_large",
    "batches_per_s_small_baseline",
    "batches_per_s_small_s3_20ms",
    "requests_per_unit_small",
    "store_cpu_ms_per_request_small",
    "idle_request_ms",
]
FAULTS = [
    "faults_trials",
    "faults_injected",
    "faults_samples_dataset",
    "faults_samples_in_model",
    "faults_lost",
    "faults_doubled",
    "faults_retrained",
    "faults_errors",
    "faults_stopped",
    *(
        f"faults_{figure}_{kind}"
        for kind in (
            "kill",
            "freeze",
            "clock",
            "hour_ahead",
            "hour_behind",
            "slow",
            "transient",
            "duplicate",
            "restart",
        )
        for figure in ("lost", "doubled")
    ),
]


SLOW = {
    "orders": [  # quick: 2,000 units
        f"orders_{figure}_{order}_{learners}"
        for figure in ("requests_per_claim", "conflicts_per_claim", "step_spread")
        for order in ("mapping", "plain", "default", "block8")
        for learners in (16, 64)
    ],
    "faults": FAULTS,  # its quick run: test_quick_kill_trials_lose_no_sample_from_the_model
    "s3_latency": S3_LATENCY,
    "shards": [  # its quick run: test_shards_quick_mode_reports_read_ratios_and_a_second_epoch_fetching_nothing
        "shards_makespan_ours",
        "shards_makespan_litdata",  # where the peers are installed (--peers)
        "shards_makespan_streaming",
        "shards_not_once_ours",
        "shards_read_ratio_parquet",
        "shards_read_ratio_parquet_split",
        "shards_read_ratio_jsonl",
        "shards_read_cpu_ratio_parquet",
        "shards_read_cpu_ratio_parquet_split",
        "shards_read_ratio_litdata",  # where the peers are installed
        "shards_epoch2_bytes_fetched",
    ],
    "training": ["loss_over_ddp", "pass_loss_over_ddp", "loss_over_single", "makespan_over_ddp", "time_to_ddp_loss"],
    "scale": SCALE,
    # Their quick runs: test_quick_groups_benchmark_reports_each_method_and_the_traffic_per_machine
    # (group_step through training --groups) and the FSDP group tests.
    "group_step": ["group_step_ratio", "group_step_s", "train_step_s", "merge_share_s"],
    "shard_step": ["shard_step_ratio", "shard_step_s", "written_models_per_interval"],
    "local_scale": [  # a full run (--large); its quick run: test_local_scale_quick_mode_runs_both_orders
        *(f"local_{figure}_{size}" for figure in ("list_page_ms", "full_scan_ms") for size in ("40k", "100k")),
        *(
            f"local_{figure}_{order}_{size}"
            for figure in ("two_over_one", "one_node_s", "cpu_floor")
            for order in ("mapping", "rotated")
            for size in ("10k", "40k", "100k")
        ),
        "local_scale_wall_s",
    ],
    "session_scale": [
        "scale_exchange_rate_64",
        "scale_lag_intervals_64",
        "scale_read_per_exchange_64",
        "scale_written_per_exchange_64",
        "scale_conflicts_per_exchange_64",
        "scale_errors_64",
    ],
    "session_processes": [
        f"processes_{figure}_{count}"
        for count in (64, 128)
        for figure in ("exchange_rate", "lag_intervals", "read_per_exchange", "written_per_exchange", "exact")
    ],
    "session_sim": [  # its quick run: tests/session/test_session_sim.py
        f"session_sim_{figure}_{count}"
        for count in (256, 1024, 4096)
        for figure in (
            "exchange_rate",
            "lag_intervals",
            "versions_lag_intervals",
            "read_per_exchange",
            "written_per_exchange",
            "reads_per_s",
            "writes_per_s",
            "exact",
        )
    ],
}
"""Run by ``--full`` only; training's quick mode is tested in ``test_training_benchmark.py``."""


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted([*FIGURES, "s3_latency", "orders"]))
def test_quick_mode_prints_its_figures_as_json_last(script: str) -> None:
    lines, figures = quick_run(script)
    assert len(lines) >= 3, lines  # a table before the JSON line
    expected = {**FIGURES, **SLOW}[script]
    missing = [name for name in expected if name not in figures]
    assert not missing, f"{script} does not report {missing}: {figures}"
    bad = {name: figures[name] for name in expected if not finite(figures[name])}
    assert not bad, f"{script} reports figures that are not finite numbers: {bad}"


@pytest.mark.slow
def test_shards_quick_mode_reports_read_ratios_and_a_second_epoch_fetching_nothing() -> None:
    pytest.importorskip("pyarrow", reason="benchmarks.shards reads Parquet and JSON Lines (the parquet extra)")
    pytest.importorskip("s3fs", reason="benchmarks.shards reads shards from moto's S3 server (the fsspec extra)")
    pytest.importorskip("moto.server", reason="benchmarks.shards reads shards from moto's S3 server")
    lines, figures = quick_run("shards")
    assert len(lines) >= 3, lines
    for case in ("parquet", "parquet_split", "jsonl"):
        ratio, spread = figures[f"shards_read_ratio_{case}"], figures[f"shards_read_ratio_{case}_spread"]
        assert finite(ratio) and finite(spread) and spread[0] <= ratio <= spread[1], (case, figures)
        assert finite(figures[f"shards_read_cpu_ratio_{case}"]), figures
    # Counted bytes, not speed: the second epoch through the cache fetches nothing, without it all again.
    assert figures["shards_epoch2_bytes_fetched"] == 0, figures
    # (a) ours on the documented case, every row once; the peers run only with --peers.
    assert finite(figures["shards_makespan_ours"]) and figures["shards_not_once_ours"] == 0, figures
    assert "shards_makespan_litdata" not in figures, figures
    assert figures["shards_epoch2_mib_fetched_uncached"] == figures["shards_epoch1_mib_fetched_cached"] > 0, figures


@pytest.mark.slow
def test_scale_quick_mode_measures_every_figure_directly() -> None:
    lines, figures = quick_run("scale")
    assert len(lines) >= 3, lines
    bad = {name: figures.get(name) for name in SCALE if not finite(figures.get(name))}
    assert not bad, f"scale reports figures that are missing or not numbers: {bad}"
    # The ladder stays below the target size, and each node of it keeps some state.
    assert figures["ladder_units"] < figures["target_units"], figures
    assert figures["ladder_nodes"] < figures["target_nodes"], figures
    assert figures["memory_mb_per_node_1m"] > 0, figures


@pytest.mark.slow
def test_local_scale_quick_mode_runs_both_orders() -> None:
    lines, figures = quick_run("local_scale")
    assert len(lines) >= 3, lines
    quick = [  # 2k units, once
        "local_list_page_ms_2k",
        "local_full_scan_ms_2k",
        *(
            f"local_{figure}_{order}_2k"
            for figure in ("two_over_one", "one_node_s", "cpu_floor")
            for order in ("mapping", "rotated")
        ),
        "local_scale_wall_s",
    ]
    bad = {name: figures.get(name) for name in quick if not finite(figures.get(name))}
    assert not bad, f"local_scale reports figures that are missing or not numbers: {bad}"


def test_scale_per_claim_extrapolation_is_linear_in_nodes_and_never_below_the_last_row() -> None:
    from benchmarks.scale import NodeCost, Row, per_claim_at

    def row(units: int, nodes: int, seconds: float) -> Row:
        return Row(units, nodes, 1.0, 2.0, 0.0, seconds, 0.0)

    startup = NodeCost(order_s=0.25, claimer_s=0.25, fingerprint_s=0.0, memory_bytes=1)  # 0.5 s a node
    costs = {(1_000, 10): startup, (2_000, 20): startup}
    # Claim loops of 1 s per 1,000 claims at 10 nodes and 3 s per 2,000 at 20 (wall less 10 x 0.5, 20 x 0.5).
    rising = [row(1_000, 10, 6.0), row(2_000, 20, 13.0)]
    assert per_claim_at(rising, costs, 40) == pytest.approx(0.0015 + 0.00005 * 20)
    falling = [row(1_000, 10, 8.0), row(2_000, 20, 13.0)]
    assert per_claim_at(falling, costs, 40) == pytest.approx(0.0015)


def test_every_script_is_run_by_python_m_benchmarks() -> None:
    from benchmarks.__main__ import FULL_SCRIPTS, SCRIPTS, SUMMARY

    assert sorted(SCRIPTS) == sorted(FIGURES)
    assert sorted(FULL_SCRIPTS) == sorted({**FIGURES, **SLOW})
    for script, figure, _ in SUMMARY:
        assert figure in {**FIGURES, **SLOW}[script], (script, figure)


def test_a_full_run_measures_the_1m_simulation_directly() -> None:
    from benchmarks.__main__ import script_command

    assert script_command("scale", quick=False)[-3:] == ["--direct", "--repeats", "3"]
    assert script_command("scale", quick=True)[-1] == "--quick"
    assert script_command("balance", quick=False)[-1] == "benchmarks.balance"
    assert script_command("throughput", quick=False)[-1] == "benchmarks.throughput"  # within 3 minutes
    assert script_command("throughput", quick=False, full=True)[-1] == "--disk"


@pytest.mark.slow
def test_quick_kill_trials_lose_no_sample_from_the_model() -> None:
    """One trial of each fault kind (benchmarks.faults: kill, freeze, clock, hour_ahead,
    hour_behind, slow, transient, duplicate, restart) on LocalMailbox: every sample of the dataset is in
    the run's state, no intruder admitted."""
    lines, figures = quick_run("faults")
    assert len(lines) >= 3, lines  # a table before the JSON line
    missing = [name for name in FAULTS if name not in figures]
    assert not missing, f"faults does not report {missing}: {figures}"
    assert all(finite(figures[name]) for name in FAULTS), figures
    assert figures["faults_store"] == "local", figures
    assert figures["faults_trials"] == 9, figures
    assert figures["faults_errors"] == 0, figures
    assert figures["faults_lost"] == 0, figures
    assert figures["faults_samples_in_model"] >= figures["faults_samples_dataset"] > 0
