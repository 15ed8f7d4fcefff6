"""The ``status``, ``plot`` and ``demo`` commands: each takes parsed arguments, returns an exit code."""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from gradientmail.cli.common import S3_READ_OPTIONS, console, json_document, open_cli_mailbox
from gradientmail.errors import UsageError


# -- formatting -----------------------------------------------------------------------------
def _ago(then: float | None, now: float) -> str:
    if then is None or not math.isfinite(then):
        return "-"
    seconds = max(0.0, now - then)
    if seconds < 60:
        return f"{seconds:.1f}s ago"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m ago"
    if seconds < 86400:
        return f"{seconds / 3600:.1f}h ago"
    try:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(then))
    except (OverflowError, OSError, ValueError):  # beyond what this platform's clock can show
        return "?"


def _count(value: float | None, digits: int = 0) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:,.{digits}f}"


def status_table(run) -> Any:
    """A rich renderable of a ``RunStatus``."""
    from rich.table import Table
    from rich.text import Text

    if run.units_total:
        share = 100.0 * run.units_claimed / run.units_total
        units = f"units claimed {run.units_claimed}/{run.units_total} ({share:.0f}%)"
    else:
        units = f"units claimed {run.units_claimed} (total unknown: no run.json)"
    created = f", created {_ago(run.created, run.read_at)}" if run.created else ""
    if run.elastic:
        units += (
            f"\ndone {len(run.done)}, in progress {run.units_in_progress}, "
            f"released {len(run.released)}, orphaned (lease expired) {len(run.orphaned)}"
        )
    table = Table(title=f"{run.mailbox}\n{units}{created}", title_justify="left")
    table.add_column("learner")
    table.add_column("units", justify="right")
    table.add_column("share", justify="right")
    table.add_column("samples", justify="right")
    in_run = any(row.samples_in_run is not None for row in run.learners)
    if in_run:  # a Session's learners: how much of what they trained the run's state holds
        table.add_column("in run", justify="right")
    table.add_column("samples/s", justify="right")
    table.add_column("steps", justify="right")
    table.add_column("last seen", justify="right")
    table.add_column("state")
    for row in run.learners:
        share = f"{100.0 * row.units / run.units_claimed:.0f}%" if run.units_claimed else "-"
        state = {True: "finished", False: "running", None: "-"}[row.finished]
        if row.lease is not None:
            state = f"{state}, lease {row.lease}" if state != "-" else f"lease {row.lease}"
        table.add_row(
            Text(row.learner),
            str(row.units),
            share,
            _count(row.samples),
            *([_count(row.samples_in_run)] if in_run else []),
            _count(row.samples_per_s, 1),
            _count(row.steps),
            _ago(row.last_seen, run.read_at),
            state,
        )
    notes = [] if run.learners else ["no learner has claimed a unit or reported progress yet"]
    notes += unreadable_notes(run)
    if notes:
        table.caption = Text("\n".join(notes))  # plain text: a record's bytes are no markup
        table.caption_justify = "left"
    return table


UNREADABLE_SHOWN = 5
"""Unusable records listed one per line under the table (``--json`` lists them all)."""


def unreadable_notes(run) -> list[str]:
    """One line per unusable record (the first few), for the table's caption."""
    if not run.unreadable:
        return []
    notes = [
        f"{len(run.unreadable)} unreadable record(s) skipped (an unreadable claim still counts as claimed, under '?'):"
    ]
    notes += [f"  {_one_line(record.problem)}" for record in run.unreadable[:UNREADABLE_SHOWN]]
    if len(run.unreadable) > UNREADABLE_SHOWN:
        notes.append(f"  ... and {len(run.unreadable) - UNREADABLE_SHOWN} more (--json lists all)")
    return notes


def _one_line(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- commands -------------------------------------------------------------------------------
def cmd_status(args: argparse.Namespace) -> int:
    """``gradientmail status URL``: the run as a table, JSON, or refreshed with ``--watch``."""
    from gradientmail.status import RunReader, require_run

    mailbox = open_cli_mailbox(args.url, endpoint_url=args.endpoint_url, s3_options=S3_READ_OPTIONS)
    reader = RunReader(mailbox, threads=args.threads)
    if not args.watch:
        run = require_run(reader.read())
        if args.json:
            print(json_document(run.to_dict(), indent=2))
        else:
            console().print(status_table(run))
        return 0

    # --watch: refresh until Ctrl-C; an empty run is shown as such (it may not have started).
    try:
        if args.json:
            while True:
                print(json_document(reader.read().to_dict()), flush=True)
                time.sleep(args.interval)
        screen = console()
        if not screen.is_terminal:
            while True:
                screen.print(status_table(reader.read()))
                screen.file.flush()
                time.sleep(args.interval)
        from rich.live import Live

        with Live(status_table(reader.read()), console=screen, auto_refresh=False) as live:
            while True:
                time.sleep(args.interval)
                live.update(status_table(reader.read()), refresh=True)
    except KeyboardInterrupt:
        return 0


def cmd_plot(args: argparse.Namespace) -> int:
    """``gradientmail plot URL -o PNG``: the run's Gantt chart."""
    from gradientmail.plot import describe_spans, plot_run, spans_from_run
    from gradientmail.status import read_run, require_run

    mailbox = open_cli_mailbox(args.url, endpoint_url=args.endpoint_url, s3_options=S3_READ_OPTIONS)
    run = require_run(read_run(mailbox, threads=args.threads))
    spans = spans_from_run(run)
    if not spans:
        raise UsageError(f"nothing to plot in {run.mailbox}: no claim records a claimed_at time")
    path = plot_run(run, args.output, title=args.title)
    print(f"wrote {path} ({run.units_claimed} units, {len(run.learners)} learners; {describe_spans(spans)})")
    return 0


def check_demo(args: argparse.Namespace) -> None:
    """Set ``args.plan``; options that parse but describe no run are argument errors (exit 2)."""
    from gradientmail.cli.demo_plan import make_plan

    args.plan = make_plan(args)


def cmd_demo(args: argparse.Namespace) -> int:
    """``gradientmail demo``: see ``gradientmail.cli.demo.run_demo``."""
    from gradientmail.cli.demo import run_demo

    return run_demo(args)
