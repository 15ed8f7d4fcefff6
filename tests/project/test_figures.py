"""Every figure the README and docs show comes from ``benchmarks/results.json``, so none can disagree.

``python -m benchmarks`` merges each run into that file (a script it ran replaces its own entry,
the others keep theirs with their command, date and machine) and renders ``RESULTS.md`` and the
pages' ``<!-- figures: NAME -->`` blocks from it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import figures, results
from benchmarks.results import ResultsError, Run

ROOT = Path(__file__).resolve().parents[2]
MEASURED = re.compile(r"(?<![\w.])\d+\.\d+(?![\w.])")
"""A decimal number: what a measured figure looks like (a count, an option's default in code, a
version in code do not)."""
CODE = re.compile(r"`[^`]*`")


def hand_figures(text: str, where: str = "<page>") -> list[str]:
    """Every table row outside a ``<!-- figures: NAME -->`` block with a decimal number in a cell
    that is not code: a figure pasted by hand, which the results file can no longer correct.

    Argument and option tables pass: their values are counts, words, or code (`` `0.1` ``).
    """
    pasted, inside = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("<!-- figures: "):
            inside = True
        elif line.startswith("<!-- /figures -->"):
            inside = False
        elif not inside and line.lstrip().startswith("|") and MEASURED.search(CODE.sub("", line)):
            pasted.append(f"{where}:{number}: {line[:100]}")
    return pasted


def test_every_page_shows_measured_figures_only_in_generated_blocks() -> None:
    pasted = [row for page in figures.pages() for row in hand_figures(page.read_text(), str(page.relative_to(ROOT)))]
    assert not pasted, "figures in tables outside <!-- figures: NAME --> blocks:\n" + "\n".join(pasted)
    readme = (ROOT / "README.md").read_text()
    assert "<!-- figures: summary -->" in readme
    assert "<!-- figures: sources -->" in (ROOT / "docs" / "benchmarks.md").read_text()


def test_a_table_pasted_by_hand_is_found_and_an_option_table_is_not() -> None:
    page = """An option table:

| option | default | meaning |
|---|---|---|
| `--batch-time SECONDS` | `0.1` | seconds per batch, 4 nodes |

<!-- figures: training -->
| `pass_loss_over_ddp` | 1.032 | generated |
<!-- /figures -->

| method | loss / DDP | time / DDP |
|---|---|---|
| `average` | 1.013 (1.012–1.013) | **0.573** |
"""
    assert hand_figures(page, "page.md") == ["page.md:13: | `average` | 1.013 (1.012–1.013) | **0.573** |"]


def test_every_described_figure_is_one_the_results_file_holds() -> None:
    from benchmarks.__main__ import DESCRIBED

    runs = results.load()
    unknown = [key for key in DESCRIBED if key[0] not in runs or key[1] not in runs[key[0]].figures]
    assert not unknown, f"DESCRIBED names figures benchmarks/results.json does not hold: {unknown}"


def run(figures_of: dict[str, float], command: str = "python -m benchmarks.x", note: str = "") -> Run:
    return Run(command, "2026-01-01", "a test machine", figures_of, 1.0, ["a table"], note)


def test_a_run_replaces_only_the_entries_of_the_scripts_it_ran(tmp_path: Path) -> None:
    output = tmp_path / "results.json"
    kept = run({"pass_loss_over_ddp": 1.03}, "python -m benchmarks.training", "not measured on this code")
    results.save({"training": kept, "epochs": run({"epochs_requests_per_claim": 99.0})}, output)
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--only", "epochs", "--output", str(output)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    merged = results.load(output)
    assert merged["training"] == kept  # not run: its figures and provenance stay
    fresh = merged["epochs"]
    assert fresh.command == "python -m benchmarks.epochs --quick"
    assert fresh.figures["epochs_requests_per_claim"] != 99.0 and fresh.lines and fresh.machine
    assert list(merged) == ["epochs", "training"]  # the scripts' order, whatever ran last
    text = output.with_suffix(".md").read_text()
    assert "`python -m benchmarks.training`" in text and "not measured on this code" in text


def test_the_tables_mark_targets_and_render_any_script() -> None:
    runs = {
        "balance": run({"shared_over_bound": 1.01, "fixed_over_bound": 2.3}),
        "stall": run({"stall_fraction": 0.5}),
        "session": run({}),
        "a_new_script": run({"new_ratio": 0.5, "new_ratio_range": [0.4, 0.6], "label": "text"}),
    }
    table = figures.render_block("all", runs)
    assert "| `shared_over_bound` | 1.01 |  | <= 1.02 | met | `balance` |" in table
    assert "| `stall_fraction` | 0.5 |  | < 0.01 | **missed** | `stall` |" in table
    assert "| `step_overhead` | n/a |  | < 0.01 | not measured | `session` |" in table
    assert "| `new_ratio` | 0.5 | 0.4–0.6 |  |  | `a_new_script` |" in table
    assert "new_ratio_range" not in table and "label" not in table
    summary = figures.render_block("summary", runs)
    assert "1 of the 2 figures with a target are met; missed: `stall_fraction`." in summary


def test_a_block_naming_nothing_known_or_left_open_is_an_error_naming_its_line() -> None:
    runs = {"balance": run({"shared_over_bound": 1.01})}
    with pytest.raises(figures.FiguresError, match=r"page\.md:3: no figures named 'balanse'"):
        figures.rewrite("a\nb\n<!-- figures: balanse -->\n<!-- /figures -->\n", runs, "page.md")
    with pytest.raises(figures.FiguresError, match=r"page\.md:2: .* without its"):
        figures.rewrite("a\n<!-- figures: balance -->\nno end\n", runs, "page.md")
    with pytest.raises(figures.FiguresError, match=r"page\.md:1: 'balance' holds no figure 'fixed_over_bound'"):
        figures.rewrite("<!-- figures: balance fixed_over_bound -->\n<!-- /figures -->\n", runs, "page.md")


def test_a_block_may_name_the_figures_of_an_entry_it_shows() -> None:
    runs = {"balance": run({"shared_over_bound": 1.01, "shared_over_bound_256": 1.04, "fixed_over_bound": 2.3})}
    text = figures.rewrite("<!-- figures: balance shared_over_bound_256 -->\n<!-- /figures -->\n", runs)
    assert "`shared_over_bound_256` | 1.04" in text
    assert "`shared_over_bound`" not in text and "`fixed_over_bound`" not in text


def test_a_lines_block_shows_the_tables_a_script_printed_and_refuses_an_entry_without_them() -> None:
    runs = {"orders": run({"units": 2000.0}), "training": Run("python -m x", "d", "m", {"a": 1.0})}
    text = figures.rewrite("<!-- figures: lines orders -->\n<!-- /figures -->\n", runs)
    assert text.startswith("<!-- figures: lines orders -->\n```text\na table\n```\n\nFrom `python -m benchmarks.x`")
    with pytest.raises(figures.FiguresError, match=r"page\.md:1: 'training' holds no printed tables"):
        figures.rewrite("<!-- figures: lines training -->\n<!-- /figures -->\n", runs, "page.md")
    with pytest.raises(figures.FiguresError, match=r"'lines' takes one entry"):
        figures.rewrite("<!-- figures: lines nothing -->\n<!-- /figures -->\n", runs, "page.md")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json", "not JSON"),
        ('{"runs": {"balance": {"date": "d", "machine": "m", "figures": {}}}}', "run 'balance': 'command'"),
        ('{"runs": {"balance": {"command": "c", "date": "d", "machine": "m", "figures": []}}}', "'figures'"),
        ('{"runs": []}', '"runs"'),
    ],
)
def test_a_malformed_results_file_is_refused_naming_the_problem(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "results.json"
    path.write_text(content)
    with pytest.raises(ResultsError, match=message):
        results.load(path)


def test_the_results_file_round_trips(tmp_path: Path) -> None:
    runs = {"balance": run({"shared_over_bound": 1.01, "shared_over_bound_range": [1.0, 1.02]})}
    results.save(runs, tmp_path / "results.json")
    assert results.load(tmp_path / "results.json") == runs
    assert json.loads((tmp_path / "results.json").read_text())["runs"]["balance"]["date"] == "2026-01-01"
