"""``python -m benchmarks.session_scale --quick`` runs the real ``Session`` at scale and reports its figures.

It checks that the benchmark runs end to end (learner threads, the paced store, consensus,
exits; and with ``--processes 2``, the learners in two worker processes on one ``LocalMailbox``)
and prints what it promises, never how fast anything is: CI machines are too noisy.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts a process that runs for several seconds

ROOT = Path(__file__).resolve().parents[2]

PER_COUNT = [
    "exchange_rate",
    "exchange_rate_mean",
    "lag_intervals",
    "lag_intervals_mean",
    "lag_s",
    "read_per_exchange",
    "read_per_exchange_max",
    "written_per_exchange",
    "written_per_exchange_max",
    "requests_per_exchange",
    "conflicts",
    "errors",
    "cpu_per_wall",
    "step_rate",
]
QUICK_COUNTS = (2, 4)


def finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def run_quick(*extra: str) -> dict[str, object]:
    """``--quick`` plus ``extra``: checks the table and the figures, returns the JSON line."""
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.session_scale", "--quick", *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    lines = completed.stdout.strip().splitlines()
    assert any(line.startswith("learners") for line in lines), completed.stdout  # the table
    figures = json.loads(lines[-1])
    assert isinstance(figures, dict)
    expected = [f"scale_{name}_{count}" for count in QUICK_COUNTS for name in PER_COUNT]
    missing = [name for name in expected if name not in figures]
    assert not missing, f"missing {missing}: {figures}"
    bad = {name: figures[name] for name in expected if not finite(figures[name])}
    assert not bad, f"figures that are not finite numbers: {bad}"
    assert figures["learners"] == list(QUICK_COUNTS)
    return figures


def test_quick_session_scale_benchmark_prints_its_figures_as_json_last() -> None:
    figures = run_quick()
    assert figures["processes"] == 1


def test_quick_session_scale_benchmark_with_learners_in_two_processes() -> None:
    """The learners dealt to two worker processes sharing a LocalMailbox: the same figures."""
    figures = run_quick("--processes", "2")
    assert figures["processes"] == 2


def test_the_issue_targets_name_the_64_learner_figures() -> None:
    from benchmarks._common import TARGETS

    for name in ("exchange_rate", "lag_intervals", "read_per_exchange", "written_per_exchange", "errors"):
        assert f"scale_{name}_64" in TARGETS, name
