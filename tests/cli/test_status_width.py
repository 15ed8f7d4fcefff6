"""``gradientmail status`` readable at 80 columns (a pipe, a default terminal).

Learner ids default to ``{hostname}-{rank}``, so names share long prefixes: cutting them at the
right edge made four learners read ``machine…``. Names are shortened from the middle and stay
distinct, states stay whole, and the table fits the width (or wraps, never cuts).
"""

from __future__ import annotations

import io
import itertools
import random
import time

import pytest
from big_run import learner_names, write_big_run
from cli_helpers import cli_env, run_cli, write_documented_run

from gradientmail import LocalMailbox, MemoryMailbox
from gradientmail.cli import status_table
from gradientmail.cli.fitting import ELLIPSIS, short_names
from gradientmail.status import read_run


def render(table, width: int) -> list[str]:
    from rich.console import Console

    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(table)
    return out.getvalue().splitlines()


def shown_names(table) -> list[str]:
    """The learner column's cells as the table holds them (what it prints, before any wrap)."""
    return [str(cell) for cell in table.columns[0].cells]


def stands_for(shown: str, name: str) -> bool:
    """Whether ``shown`` is ``name``, or ``name`` shortened from the middle."""
    if ELLIPSIS not in shown:
        return shown == name
    head, _, tail = shown.partition(ELLIPSIS)
    return name.startswith(head) and name.endswith(tail) and len(shown) < len(name)


def _run(names_by_host: dict[str, int], *, units: int = 24, samples_in_run: bool = False):
    box = MemoryMailbox(f"width-{random.random()}")
    for host, learners in names_by_host.items():
        write_big_run(box, units=units, learners=learners, host=host)
    run = read_run(box)
    if samples_in_run:
        for row in run.learners:
            row.samples_in_run = row.samples
    return run


HOSTS = [
    {"machine-with-a-long-hostname": 4},
    {"gpu-box-a-with-a-long-name": 2, "gpu-box-b-with-a-long-name": 2},
    {"ip-10-0-12-34.eu-west-1.compute.internal": 8},
]


@pytest.mark.parametrize("hosts", HOSTS, ids=lambda hosts: next(iter(hosts)))
@pytest.mark.parametrize("width", [80, 100, 132])
@pytest.mark.parametrize("samples_in_run", [False, True])
def test_names_stay_distinct_and_whole_in_the_width(hosts, width, samples_in_run):
    run = _run(hosts, samples_in_run=samples_in_run)
    table = status_table(run, width)
    shown = shown_names(table)
    learners = [row.learner for row in run.learners]
    assert len(set(shown)) == len(shown) == len(learners), shown
    assert all(stands_for(text, name) for text, name in zip(shown, learners, strict=True)), shown
    lines = render(table, width)
    assert max(len(line) for line in lines) <= width, "\n".join(lines)
    text = "\n".join(lines)
    for name in shown:  # printed whole, not cut again by the table
        assert sum(name in line for line in lines) == 1, (name, text)
    assert text.count("finished") == len(learners) and text.count("lease stopped") == len(learners), text
    assert "finishe…" not in text and "stoppe…" not in text


def test_a_table_that_fits_is_left_as_it_was():
    box = MemoryMailbox(f"width-run-{random.random()}")
    write_documented_run(box, t0=time.time() - 60)
    run = read_run(box)
    table = status_table(run, 80)
    assert shown_names(table) == ["node-A", "node-B", "node-C", "node-D"]
    lines = render(table, 80)
    assert any("┃ learner" in line for line in lines), "\n".join(lines)  # boxed, as docs/cli.md shows it
    assert any("7,040" in line for line in lines)  # counts in full


def test_too_narrow_for_any_layout_wraps_cells_without_cutting_them():
    run = _run({"machine-with-a-long-hostname": 4})
    table = status_table(run, 40)
    shown = shown_names(table)
    assert len(set(shown)) == 4
    text = "\n".join(render(table, 40))
    assert text.count(ELLIPSIS) == sum(name.count(ELLIPSIS) for name in shown), text  # folded, never cut


def test_no_width_shows_names_whole():
    run = _run({"machine-with-a-long-hostname": 4})
    assert shown_names(status_table(run)) == learner_names(4)


def test_short_names_are_distinct_or_whole():
    rng = random.Random(0)
    for _ in range(200):
        hosts = [f"{rng.choice(['gpu', 'node', 'ip-10-0'])}-{rng.randrange(100)}-long-suffix" for _ in range(3)]
        names = sorted({f"{host}-{rank}" for host, rank in itertools.product(hosts, range(rng.randrange(1, 9)))})
        width = rng.randrange(2, 40)
        shown = short_names(names, width)
        assert list(shown) == names
        if any(ELLIPSIS in text for text in shown.values()):
            assert len(set(shown.values())) == len(names)
            assert all(len(text) <= width for text in shown.values())
            assert all(stands_for(text, name) for name, text in shown.items())
        else:
            assert shown == {name: name for name in names}


@pytest.mark.slow
def test_status_at_80_columns_names_every_learner_distinctly(tmp_path):
    """``COLUMNS=80 gradientmail status URL`` names every learner."""
    box = LocalMailbox(tmp_path / "run")
    names = write_big_run(box, units=40, learners=4)
    result = run_cli("status", str(tmp_path / "run"), env=cli_env(COLUMNS="80"))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, result.stdout
    rows = [line.replace("│", " ").split() for line in lines]
    firsts = [cells[0] for cells in rows if len(cells) > 2 and cells[1].isdigit()]
    assert len(firsts) == 4 and len(set(firsts)) == 4, result.stdout
    for name in names:
        assert sum(stands_for(first, name) for first in firsts) == 1, (name, result.stdout)
    assert result.stdout.count("finished") == 4
    assert not any("…" in " ".join(cells[1:]) for cells in rows), result.stdout  # only names are shortened


def test_columns_nobody_fills_go_before_any_name_is_shortened():
    """A run of claims alone (no Session, no lease): samples/s, steps and last seen hold only
    ``-``. At 80 columns they are left out, and 11-character names stay whole."""
    box = MemoryMailbox(f"width-{random.random()}")
    names = [f"machine-{letter}-0" for letter in "abcdefgh"]
    write_documented_run(box, progress=False)
    for index, name in enumerate(names):  # one more claim each, under the long names
        box.put_if_absent(f"units/extra-{index}", f'{{"learner": "{name}", "token": "t{index}"}}'.encode())
    table = status_table(read_run(box), width=80)
    headers = [str(column.header) for column in table.columns]
    assert "steps" not in headers and "last seen" not in headers and "samples/s" not in headers, headers
    assert set(names) <= set(shown_names(table)), shown_names(table)
    assert max(len(line) for line in render(table, 80)) <= 80
    wide = status_table(read_run(box), width=None)
    assert "steps" in [str(column.header) for column in wide.columns], "with room, every column stays"
