"""``python -m benchmarks.session_scale --quick`` runs the real ``Session`` at scale and reports its figures.

It checks that the benchmark runs end to end (learner threads, the paced store, consensus,
exits; and with ``--processes 2``, the learners in two worker processes on one ``LocalMailbox``)
and prints what it promises, never how fast anything is: CI machines are too noisy.
"""

from __future__ import annotations

import pytest
from benchmark_runs import finite, quick_run  # tests/helpers/ is on sys.path (tests/conftest.py)

pytestmark = pytest.mark.slow  # starts a process that runs for several seconds


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


def run_quick(*extra: str, counts: tuple[int, ...] = QUICK_COUNTS) -> dict[str, object]:
    """``--quick`` plus ``extra``: checks the table and the figures, returns the JSON line."""
    lines, figures = quick_run("session_scale", *extra)
    assert any(line.startswith("learners") for line in lines), lines  # the table
    expected = [f"scale_{name}_{count}" for count in counts for name in PER_COUNT]
    missing = [name for name in expected if name not in figures]
    assert not missing, f"missing {missing}: {figures}"
    bad = {name: figures[name] for name in expected if not finite(figures[name])}
    assert not bad, f"figures that are not finite numbers: {bad}"
    assert figures["learners"] == list(counts)
    return figures


def test_quick_session_scale_benchmark_prints_its_figures_as_json_last() -> None:
    figures = run_quick()
    assert figures["processes"] == 1


def test_quick_session_scale_benchmark_with_learners_in_two_processes() -> None:
    """The learners dealt to two worker processes sharing a LocalMailbox: the same figures."""
    figures = run_quick("--processes", "2", "--learners", "4", counts=(4,))  # one row: processes start slowly
    assert figures["processes"] == 2


def test_the_issue_targets_name_the_64_learner_figures() -> None:
    from benchmarks._common import TARGETS

    for name in ("exchange_rate", "lag_intervals", "read_per_exchange", "written_per_exchange", "errors"):
        assert f"scale_{name}_64" in TARGETS, name


def test_session_processes_quick_mode_runs_learners_in_processes_and_folds_each_sample_once() -> None:
    lines, figures = quick_run("session_processes")
    assert any(line.startswith("learners") for line in lines), lines
    assert figures["processes"] == 2 and figures["learners"] == [8], figures
    assert figures["processes_errors_8"] == 0.0 and figures["processes_exact_8"] == 1.0, figures
    assert finite(figures["processes_exchange_rate_8"]) and finite(figures["processes_read_per_exchange_8"])
