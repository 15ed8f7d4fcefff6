"""Every benchmark script runs in its quick mode and ends with its figures as one JSON line.

These tests check that the benchmarks execute and report what they promise, never how fast
anything is: CI machines are too noisy for speed bars, and the figures are judged in
``benchmarks/RESULTS.md`` instead.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FIGURES = {
    "balance": [
        "shared_over_bound", "fixed_over_bound", "shared_over_bound_4", "shared_over_bound_64",
        "shared_over_bound_256", "fixed_over_bound_256", "shared_over_bound_slowdown",
        "fixed_over_bound_slowdown", "seed_makespan", "seed_fixed_makespan", "seed_units",
    ],
    "requests": [
        "requests_per_claim", "conflicts_per_claim", "requests_per_claim_no_rotation",
        "conflicts_per_claim_no_rotation", "requests_per_claim_threads", "conflicts_per_claim_threads",
        "requests_per_claim_threads_no_rotation", "conflicts_per_claim_threads_no_rotation",
    ],
    "throughput": [
        "ratio_local", "ratio_latency_20ms", "ratio_latency_100ms", "ratio_disk", "ratio_local_small",
        "ratio_local_large", "batches_per_s_small_baseline", "batches_per_s_large_baseline",
    ],
    "stall": [
        "stall_fraction", "stall_fraction_20ms", "stall_fraction_100ms", "stall_fraction_dataloader",
        "stall_fraction_workers0", "handoff_ms",
    ],
    "session": ["step_overhead", "step_overhead_exchange", "step_overhead_merge"],
    "session_figures": ["drag", "read_per_exchange", "drag_every_1", "drag_every_4", "drag_every_16",
                        "read_per_exchange_4", "read_per_exchange_16", "read_per_exchange_64"],
}
SLOW = {"training": ["loss_over_ddp", "loss_over_single", "makespan_over_ddp", "time_to_ddp_loss"]}
"""Run by ``--full`` only; its quick mode is tested in ``test_training_benchmark.py``."""


def finite_numbers(value: object) -> bool:
    values = value if isinstance(value, list) else [value]
    return bool(values) and all(
        isinstance(item, (int, float)) and not isinstance(item, bool) and math.isfinite(item)
        for item in values
    )


@pytest.mark.parametrize("script", sorted(FIGURES))
def test_quick_mode_prints_its_figures_as_json_last(script: str) -> None:
    completed = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{script}", "--quick"],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    lines = completed.stdout.strip().splitlines()
    assert len(lines) >= 3, completed.stdout  # a table before the JSON line
    figures = json.loads(lines[-1])
    assert isinstance(figures, dict)
    missing = [name for name in FIGURES[script] if name not in figures]
    assert not missing, f"{script} does not report {missing}: {figures}"
    bad = {name: figures[name] for name in FIGURES[script] if not finite_numbers(figures[name])}
    assert not bad, f"{script} reports figures that are not finite numbers: {bad}"


def test_every_script_is_run_by_python_m_benchmarks() -> None:
    from benchmarks.__main__ import FULL_SCRIPTS, SCRIPTS, SUMMARY

    assert sorted(SCRIPTS) == sorted(FIGURES)
    assert sorted(FULL_SCRIPTS) == sorted({**FIGURES, **SLOW})
    for script, figure, _ in SUMMARY:
        assert figure in {**FIGURES, **SLOW}[script], (script, figure)


def test_results_table_marks_targets() -> None:
    from benchmarks.__main__ import Outcome, render

    outcomes = {
        "balance": Outcome("balance", 0, 1.0, ["a table"], {"shared_over_bound": 1.01, "fixed_over_bound": 2.3}),
        "stall": Outcome("stall", 0, 1.0, ["a table"], {"stall_fraction": 0.5}),
        "session": Outcome("session", 1, 1.0, ["Traceback ..."], None),
    }
    text = render(outcomes, 3.0, quick=True)
    assert "| `shared_over_bound` | 1.0100 | <= 1.05 | met |" in text
    assert "| `stall_fraction` | 0.5000 | < 0.01 | **missed** |" in text
    assert "| `step_overhead` | n/a | < 0.01 | not measured |" in text
    assert "`python -m benchmarks.session` **failed (exit code 1)**" in text
