"""``status`` and ``plot`` of a many-unit run.

A 100k-unit run took ``status`` 15.6 s and 428 MB, ``plot`` minutes and 1.67 GB for a chart of
100k illegible bars. What is pinned here is the shape of the work, never its time: a chart of
many units draws a few shapes per learner, not one per unit; claim bodies are read in batches,
serially on a local store; building the parser imports no torch. docs/cli.md has the figures.
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from big_run import write_big_run
from cli_helpers import cli_env

from gradientmail import LocalMailbox, MemoryMailbox
from gradientmail.mailbox.wrappers import DelayedMailbox
from gradientmail.plot import MAX_BARS, Span, describe_spans, draw_gantt, merge_spans, plot_run, spans_from_run
from gradientmail.status import DEFAULT_THREADS, RunReader, default_threads, read_run


def _run(units: int, learners: int = 4):
    box = MemoryMailbox(f"scale-{random.random()}")
    names = write_big_run(box, units=units, learners=learners)
    return box, names


def _drawn(ax) -> tuple[int, int]:
    """(rectangles, collections) on ``ax``: one rectangle per ``barh`` bar."""
    return len(ax.patches), len(ax.collections)


@pytest.mark.slow
def test_a_chart_of_many_units_draws_each_learner_busy_time_not_a_bar_per_unit():
    box, names = _run(units=3 * MAX_BARS)
    run = read_run(box)
    spans = spans_from_run(run)
    assert len(spans) == 3 * MAX_BARS
    ax = draw_gantt(spans, rows=names)
    rectangles, collections = _drawn(ax)
    assert rectangles == 0 and 1 <= collections <= 2 * len(names)
    labels = [tick.get_text() for tick in ax.get_yticklabels()]
    units = {row.learner: row.units for row in run.learners}
    assert labels == [f"{name} ({units[name]:,} units)" for name in names]
    assert "busy time" in describe_spans(spans)


@pytest.mark.slow
def test_a_chart_of_few_units_keeps_a_bar_per_unit():
    box, names = _run(units=40)
    spans = spans_from_run(read_run(box))
    ax = draw_gantt(spans, rows=names)
    assert _drawn(ax) == (40, 0)
    assert [tick.get_text() for tick in ax.get_yticklabels()] == names
    assert "busy time" not in describe_spans(spans)


def test_busy_time_merges_what_lies_closer_than_the_gap():
    spans = [
        Span("A", "u2", 5.0, 6.0),
        Span("A", "u0", 0.0, 1.0),
        Span("A", "u1", 1.0005, 2.0),
        Span("B", "u3", 0.0, 3.0),
        Span("B", "u4", 1.0, 2.0),  # inside the one before
    ]
    assert merge_spans(spans, gap=0.001) == {"A": [(0.0, 2.0), (5.0, 6.0)], "B": [(0.0, 3.0)]}
    assert merge_spans(spans, gap=10.0)["A"] == [(0.0, 6.0)]


@pytest.mark.slow
def test_plot_run_of_many_units_writes_a_png(tmp_path):
    box, _ = _run(units=2 * MAX_BARS)
    path = plot_run(read_run(box), tmp_path / "gantt.png")
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_claims_are_read_in_batches_with_the_same_result(monkeypatch):
    import gradientmail.status as status

    box, _ = _run(units=50)
    serial = RunReader(box, threads=1).read()
    monkeypatch.setattr(status, "FETCH_CHUNK", 7)
    batched = RunReader(box, threads=4).read()
    assert batched.to_dict() | {"read_at": 0} == serial.to_dict() | {"read_at": 0}
    assert batched.claims == serial.claims


def test_reads_are_serial_on_a_local_store_and_parallel_across_a_network(tmp_path):
    assert default_threads(LocalMailbox(tmp_path / "run")) == 1
    assert default_threads(MemoryMailbox(f"scale-{random.random()}")) == 1
    remote = DelayedMailbox(MemoryMailbox(f"scale-{random.random()}"), 0.0)
    assert default_threads(remote) == DEFAULT_THREADS
    assert RunReader(remote).threads == DEFAULT_THREADS and RunReader(remote, threads=3).threads == 3


def test_status_table_has_a_row_per_learner_whatever_the_units():
    from gradientmail.cli import status_table

    box, names = _run(units=3 * MAX_BARS)
    table = status_table(read_run(box), 80)
    assert table.row_count == len(names)


@pytest.mark.slow
def test_building_the_parser_imports_no_torch():
    """Every command builds the whole parser; ``tokens`` must not bring torch to ``status``."""
    code = (
        "import sys; from gradientmail.cli.parser import build_parser; build_parser(); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env())
    assert result.returncode == 0, result.stderr


def test_token_dtype_names_match_the_formats():
    from gradientmail.cli.tokens import DTYPE_NAMES
    from gradientmail.data.formats import DTYPES

    assert sorted(DTYPE_NAMES) == sorted(DTYPES)


@pytest.mark.slow
def test_plot_command_of_many_units_says_what_the_rows_show(tmp_path):
    from cli_helpers import run_cli

    write_big_run(LocalMailbox(tmp_path / "run"), units=2 * MAX_BARS)
    result = run_cli("plot", str(tmp_path / "run"), "-o", str(tmp_path / "gantt.png"))
    assert result.returncode == 0, result.stderr
    assert "busy time" in result.stdout and f"{2 * MAX_BARS} units" in result.stdout
