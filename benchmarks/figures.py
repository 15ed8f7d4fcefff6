"""Figure tables generated from the results file, so no page can show a figure it does not hold.

Usage: ``python -m benchmarks.figures [--check]``. Rewrites
``benchmarks/RESULTS.md`` and every marked block of ``README.md`` and ``docs/*.md``::

    <!-- figures: NAME -->
    (generated: never edit by hand)
    <!-- /figures -->

``NAME`` is ``summary`` (the README's few headline figures and the count of targets met),
``sources`` (each entry's command, date and machine, once), ``all`` (every figure), the name of
an entry of the results file (``balance``, ``training_long``, ...: that entry's figures), or
``lines`` and an entry's name (``lines orders``: the tables that entry's script printed).
``--check`` writes nothing and exits 1 naming every page whose blocks differ from the file.
``python -m benchmarks`` runs this after every run.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from benchmarks._common import TARGETS
from benchmarks.results import RESULTS_JSON, Run, is_number, load, spread

ROOT = Path(__file__).resolve().parent.parent
RESULTS_MD = Path(__file__).with_name("RESULTS.md")
BLOCK = re.compile(r"<!-- figures: (?P<name>[^>]*?) -->\n(?P<body>.*?)<!-- /figures -->", re.DOTALL)
OPENING = re.compile(r"<!-- figures: ")
SPREAD_SUFFIXES = ("_range", "_spread", "_min", "_max")
HEADLINE = (
    "shared_over_bound",
    "small_units_makespan",
    "ratio_local",
    "step_overhead",
    "pass_loss_over_ddp",
    "faults_lost",
    "shards_makespan_ours",
    "shards_makespan_litdata",
    "groups_makespan_over_ddp",
    "groups_read_per_machine",
)
"""The figures the README's ``summary`` block shows (those present in the results file)."""


class FiguresError(ValueError):
    """A page's figure block cannot be rendered; the message names the page and line."""


@dataclass(frozen=True)
class Row:
    """One figure as the tables show it."""

    run: str
    figure: str
    value: str
    spread: str
    target: str
    verdict: str
    meaning: str


def pages(root: Path = ROOT) -> list[Path]:
    """The pages that may hold figure blocks: the README and every page of ``docs/``."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def number(value: float) -> str:
    """Four significant digits, an integer as an integer."""
    if isinstance(value, int) or float(value).is_integer() and abs(value) >= 1:
        return f"{int(value)}"
    return f"{value:.4g}"


def summary_meanings() -> dict[tuple[str, str], str]:
    """``SUMMARY``'s meanings by (script, figure); imported late: ``benchmarks.__main__`` imports
    this module."""
    from benchmarks.__main__ import SUMMARY

    return {(script, figure): meaning for script, figure, meaning in SUMMARY}


def described() -> dict[tuple[str, str], str]:
    """``DESCRIBED``: meanings of figures shown only where a page names them (imported late, as
    ``summary_meanings``)."""
    from benchmarks.__main__ import DESCRIBED

    return DESCRIBED


def rows_of(name: str, run: Run, meanings: Mapping[tuple[str, str], str], chosen: list[str] | None = None) -> list[Row]:
    """The rows of one entry: the ``chosen`` figures, or by default its ``SUMMARY`` figures, then
    any other figure with a target, or, for an entry that has neither (a script new to the
    summary), every numeric figure."""
    if chosen is None:
        chosen = [figure for script, figure in meanings if script == name]
        chosen += [figure for figure in run.figures if figure in TARGETS and figure not in chosen]
    if not chosen:
        chosen = [
            figure for figure, value in run.figures.items() if is_number(value) and not figure.endswith(SPREAD_SUFFIXES)
        ]
    rows = [figure_row(name, run, meanings, figure) for figure in chosen]
    return [row for row in rows if row is not None]


def figure_row(name: str, run: Run, meanings: Mapping[tuple[str, str], str], figure: str) -> Row | None:
    """One figure of entry ``name`` as a row; None for an optional figure this run did not measure."""
    value, target = run.figures.get(figure), TARGETS.get(figure)
    if not is_number(value) and target is None:
        return None
    meaning = meanings.get((name, figure)) or described().get((name, figure))
    meaning = meaning or (target.meaning if target is not None else "")
    if not is_number(value):
        return Row(name, figure, "n/a", "", target.text() if target is not None else "", "not measured", meaning)
    low_high = spread(run.figures, figure)
    spread_text = "" if low_high is None else f"{number(low_high[0])}–{number(low_high[1])}"
    verdict = "" if target is None else ("met" if target.met(value) else "**missed**")
    return Row(name, figure, number(value), spread_text, "" if target is None else target.text(), verdict, meaning)


def table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(["---"] * len(headers)) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def render_sources(runs: Mapping[str, Run]) -> str:
    rows = [[f"`{name}`", f"`{run.command}`", run.date, run.machine, run.note] for name, run in runs.items()]
    return table(["figures of", "command", "date", "machine", "note"], rows)


def render_all(runs: Mapping[str, Run], meanings: Mapping[tuple[str, str], str]) -> str:
    rows = [
        [f"`{row.figure}`", row.value, row.spread, row.target, row.verdict, f"`{row.run}`", row.meaning]
        for name, run in runs.items()
        for row in rows_of(name, run, meanings)
    ]
    return table(["figure", "value", "spread", "target", "", "from", "meaning"], rows)


def render_run(name: str, run: Run, meanings: Mapping[tuple[str, str], str], chosen: list[str] | None = None) -> str:
    rows = [
        [f"`{row.figure}`", row.value, row.spread, row.target, row.verdict, row.meaning]
        for row in rows_of(name, run, meanings, chosen)
    ]
    provenance = f"`{run.command}`, {run.date}, {run.machine}" + (f"; {run.note}" if run.note else "")
    return table(["figure", "value", "spread", "target", "", "meaning"], rows) + f"\n\nFrom {provenance}."


def render_lines(name: str, run: Run) -> str:
    """The tables the script of entry ``name`` printed, as it printed them, then where they come from.

    Raises:
        FiguresError: the entry holds no printed lines (figures carried over without them).
    """
    if not run.lines:
        raise FiguresError(f"{name!r} holds no printed tables (run its command again to record them)")
    provenance = f"`{run.command}`, {run.date}, {run.machine}" + (f"; {run.note}" if run.note else "")
    return "\n".join(["```text", *run.lines, "```", "", f"From {provenance}."])


def render_summary(runs: Mapping[str, Run], meanings: Mapping[tuple[str, str], str]) -> str:
    every = [row for name, run in runs.items() for row in rows_of(name, run, meanings)]
    judged = [row for row in every if row.verdict in ("met", "**missed**")]
    missed = [f"`{row.figure}`" for row in judged if row.verdict != "met"]
    headline = {row.figure: row for row in every}
    rows = [
        [f"`{figure}`", row.value, row.target, row.verdict, row.meaning]
        for figure in HEADLINE
        if (row := headline.get(figure)) is not None
    ]
    met = len(judged) - len(missed)
    count = f"{met} of the {len(judged)} figures with a target are met" + (
        f"; missed: {', '.join(missed)}." if missed else "."
    )
    return table(["figure", "value", "target", "", "meaning"], rows) + "\n\n" + count


def render_block(name: str, runs: Mapping[str, Run]) -> str:
    """The text of block ``name`` (without its markers), ending in a newline.

    ``name`` is ``summary``, ``sources``, ``all``, an entry of the results file, an entry
    followed by the figures of it to show (``session_scale scale_exchange_rate_4 ...``), or
    ``lines`` followed by an entry (the tables its script printed).

    Raises:
        FiguresError: ``name`` is neither a block kind nor an entry of the results file, names
            a figure its entry does not hold, or asks for the lines of an entry that has none.
    """
    meanings = summary_meanings()
    entry, *chosen = name.split()
    if name == "summary":
        text = render_summary(runs, meanings)
    elif name == "sources":
        text = render_sources(runs)
    elif name == "all":
        text = render_all(runs, meanings)
    elif entry == "lines":
        if len(chosen) != 1 or chosen[0] not in runs:
            raise FiguresError(f"'lines' takes one entry of the results file (known: {', '.join(runs)})")
        text = render_lines(chosen[0], runs[chosen[0]])
    elif entry in runs:
        missing = [figure for figure in chosen if not is_number(runs[entry].figures.get(figure))]
        if missing:
            raise FiguresError(f"{entry!r} holds no figure {', '.join(map(repr, missing))}")
        text = render_run(entry, runs[entry], meanings, chosen or None)
    else:
        known = ", ".join(["summary", "sources", "all", "lines ENTRY", *runs])
        raise FiguresError(f"no figures named {entry!r} (known: {known})")
    return text + "\n"


def rewrite(text: str, runs: Mapping[str, Run], where: str = "<page>") -> str:
    """``text`` with every figure block rendered again from ``runs``.

    Raises:
        FiguresError: a block names nothing known, or a marker is not closed; names ``where:line``.
    """
    if len(OPENING.findall(text)) != len(BLOCK.findall(text)):
        line = text.count("\n", 0, text.rfind("<!-- figures: ")) + 1
        raise FiguresError(f"{where}:{line}: a '<!-- figures: NAME -->' marker without its '<!-- /figures -->'")

    def replace(match: re.Match[str]) -> str:
        name = match["name"].strip()
        try:
            body = render_block(name, runs)
        except FiguresError as error:
            line = text.count("\n", 0, match.start()) + 1
            raise FiguresError(f"{where}:{line}: {error}") from None
        return f"<!-- figures: {name} -->\n{body}<!-- /figures -->"

    return BLOCK.sub(replace, text)


def render_results_md(runs: Mapping[str, Run], results: Path = RESULTS_JSON) -> str:
    """``benchmarks/RESULTS.md``: where each entry comes from, every figure, then each script's
    own printed tables."""
    meanings = summary_meanings()
    parts = [
        "# Benchmark results",
        "",
        f"Generated from `benchmarks/{results.name}` by `python -m benchmarks.figures` (which "
        "`python -m benchmarks` runs after every run): do not edit by hand.",
        "",
        render_sources(runs),
        "",
        render_all(runs, meanings),
        "",
    ]
    for name, run in runs.items():
        seconds = "" if run.seconds is None else f", {run.seconds:.0f} s"
        parts += [f"## {name}", "", f"`{run.command}`, {run.date}, {run.machine}{seconds}."]
        if run.note:
            parts += ["", run.note[0].upper() + run.note[1:] + "."]
        parts += [""]
        if run.lines:
            parts += ["```text", *run.lines, "```", ""]
    return "\n".join(parts)


def stale(runs: Mapping[str, Run], root: Path = ROOT) -> dict[Path, str]:
    """Every page (and ``benchmarks/RESULTS.md``) whose text differs from its rendering from
    ``runs``, with the text it should have."""
    wanted = {}
    for page in pages(root):
        text = page.read_text()
        rendered = rewrite(text, runs, str(page.relative_to(root)))
        if rendered != text:
            wanted[page] = rendered
    results_md = root / "benchmarks" / RESULTS_MD.name
    rendered = render_results_md(runs)
    if not results_md.exists() or results_md.read_text() != rendered:
        wanted[results_md] = rendered
    return wanted


def write_all(runs: Mapping[str, Run], root: Path = ROOT) -> list[Path]:
    """Bring every page and ``benchmarks/RESULTS.md`` up to date with ``runs``; the pages written."""
    wanted = stale(runs, root)
    for page, text in wanted.items():
        page.write_text(text)
    return list(wanted)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is out of date")
    args = parser.parse_args(argv)
    runs = load(RESULTS_JSON)
    if not runs:
        print(f"{RESULTS_JSON}: no figures to render", file=sys.stderr)
        return 1
    if args.check:
        wanted = stale(runs)
        for page in wanted:
            print(f"{page}: figures differ from {RESULTS_JSON.name}; run python -m benchmarks.figures")
        return 1 if wanted else 0
    for page in write_all(runs):
        print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
