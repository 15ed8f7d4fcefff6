"""The ``status``, ``plot`` and ``demo`` commands: each takes parsed arguments, returns an exit code."""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from gradientmail.cli.fitting import compact_count, short_names
from gradientmail.cli.mailbox_url import S3_READ_OPTIONS, open_cli_mailbox
from gradientmail.cli.output import console, json_document
from gradientmail.errors import UsageError


# -- formatting -----------------------------------------------------------------------------
def _ago(then: float | None, now: float) -> str:
    """How long ago, in at most 10 characters: ``12.5s ago``, ``3.2d ago``, ``2023-11-14``."""
    if then is None or not math.isfinite(then):
        return "-"
    seconds = max(0.0, now - then)
    for limit, unit, scale in ((60, "s", 1), (3600, "m", 60), (86400, "h", 3600), (30 * 86400, "d", 86400)):
        if seconds < limit:
            return f"{seconds / scale:.1f}{unit} ago"
    try:
        return time.strftime("%Y-%m-%d", time.localtime(then))
    except (OverflowError, OSError, ValueError):  # beyond what this platform's clock can show
        return "?"


def _count(value: float | None, digits: int = 0) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:,.{digits}f}"


MIN_NAME_WIDTH = 10
"""Learner names are shortened (from the middle, kept distinct) to no fewer characters."""


def status_table(run, width: int | None = None) -> Any:
    """A rich renderable of a ``RunStatus``, fitted to ``width`` columns (None: no limit).

    What does not fit is made smaller step by step: columns where no learner shows anything
    left out, large counts written compactly (``1.54M``) and learner names shortened from the
    middle, each still distinct (``cli.fitting``); then
    the same without the box's lines. A table still too wide wraps its cells: a name or a state
    is never cut short.
    """
    table = _table(run)
    if width is None or _natural_width(table) <= width:
        return table
    for plain in (False, True):
        table = _table(run, compact=True, plain=plain, drop_empty=True)
        excess = _natural_width(table) - width
        longest = max((len(row.learner) for row in run.learners), default=0)
        if excess > 0 and longest > MIN_NAME_WIDTH:
            names = short_names((row.learner for row in run.learners), max(MIN_NAME_WIDTH, longest - excess))
            table = _table(run, compact=True, plain=plain, names=names, drop_empty=True)
        if _natural_width(table) <= width:
            break
    return table


def _natural_width(table: Any) -> int:
    """The width ``table`` takes when nothing limits it."""
    from rich.console import Console
    from rich.measure import Measurement

    wide = Console(width=100_000)
    return Measurement.get(wide, wide.options, table).maximum


def _table(
    run,
    *,
    compact: bool = False,
    plain: bool = False,
    names: dict[str, str] | None = None,
    drop_empty: bool = False,
) -> Any:
    """The status table; ``compact``: counts as ``1.54M`` and a lease on its own line;
    ``plain``: columns one space apart, no lines but the header's; ``drop_empty``: leave out
    the columns where every learner shows ``-`` (nothing known), before names are shortened."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    count = compact_count if compact else _count
    if run.units_total:
        share = 100.0 * run.units_claimed / run.units_total
        units = f"units claimed {run.units_claimed}/{run.units_total} ({share:.0f}%)"
    else:
        units = f"units claimed {run.units_claimed} (total unknown: no run.json)"
    created = f", created {_ago(run.created, run.read_at)}" if run.created else ""
    units += created
    if run.elastic:
        units += (
            f"\ndone {len(run.done)}, in progress {run.units_in_progress}, "
            f"released {len(run.released)}, orphaned (lease expired) {len(run.orphaned)}"
        )
    table = Table(title=f"{run.mailbox}\n{units}", title_justify="left")
    if plain:
        table.box, table.show_edge, table.padding, table.pad_edge = box.SIMPLE_HEAD, False, (0, 0), False
    in_run = any(row.samples_in_run is not None for row in run.learners)
    # (header, right-aligned) of each column; "in run": a Session's learners, how much of what
    # they trained the run's state holds.
    unfinished = any(row.unfinished for row in run.learners)  # the column only when some are left
    columns = [("learner", False), ("units", True)]
    columns += [("not done", True)] if unfinished else []
    columns += [("share", True), ("samples", True)]
    columns += [("in run", True)] if in_run else []
    columns += [("samples/s", True), ("steps", True), ("last seen", True), ("state", False)]
    rows = []
    for row in run.learners:
        share = f"{100.0 * row.units / run.units_claimed:.0f}%" if run.units_claimed else "-"
        state = _state(row, run.read_at, "\n" if compact else ", ")
        rows.append(
            [
                (names or {}).get(row.learner, row.learner),
                str(row.units),
                *([str(row.unfinished) if row.unfinished else "-"] if unfinished else []),
                share,
                count(row.samples),
                *([count(row.samples_in_run)] if in_run else []),
                count(row.samples_per_s, 1),
                count(row.steps),
                _ago(row.last_seen, run.read_at),
                state,
            ]
        )
    keep = [
        index
        for index in range(len(columns))
        if index == 0 or not drop_empty or not rows or any(cells[index] != "-" for cells in rows)
    ]
    for index in keep:
        header, right = columns[index]
        # "fold": a cell too wide for its column wraps whole; rich's default cuts it to "machine…".
        table.add_column(header, justify="right" if right else "left", overflow="fold")
    for cells in rows:
        table.add_row(*(Text(cells[index]) if index == 0 else cells[index] for index in keep))
    notes = [] if run.learners else ["no learner has claimed a unit or reported progress yet"]
    notes += unfinished_notes(run)
    notes += unreadable_notes(run)
    if notes:
        table.caption = Text("\n".join(notes))  # plain text: a record's bytes are no markup
        table.caption_justify = "left"
    return table


def unfinished_notes(run) -> list[str]:
    """One line per learner holding units claimed and not finished, naming the first few: a
    learner that is not running leaves them untrained until its id takes them back."""
    notes = []
    for learner, units in run.unfinished.items():
        shown = ", ".join(units[:UNREADABLE_SHOWN]) + (", ..." if len(units) > UNREADABLE_SHOWN else "")
        notes.append(f"claimed and not finished by {learner}: {len(units)} unit(s) ({shown})")
    return notes


def _state(row, now: float, joint: str) -> str:
    """A learner's state cell: finished or running, with its lease when it holds one; without a
    lease, what its presence record says: stopped, or last seen when it may be dead."""
    state = {True: "finished", False: "running", None: "-"}[row.finished]
    if row.lease is not None:
        return f"{state}{joint}lease {row.lease}" if state != "-" else f"lease {row.lease}"
    if row.may_be_dead:
        return f"last seen {_ago(row.seen_alive, now)}{joint}may be dead"
    if row.presence == "stopped" and not row.finished:
        return "stopped"
    if row.presence == "live" and row.finished is None:
        return "running"
    return state


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
            screen = console()
            screen.print(status_table(run, screen.width))
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
                screen.print(status_table(reader.read(), screen.width))
                screen.file.flush()
                time.sleep(args.interval)
        from rich.live import Live

        with Live(status_table(reader.read(), screen.width), console=screen, auto_refresh=False) as live:
            while True:
                time.sleep(args.interval)
                live.update(status_table(reader.read(), screen.width), refresh=True)
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
    path = plot_run(run, args.output, title=args.title, spans=spans)
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


def cmd_bucket(args: argparse.Namespace) -> int:
    """``gradientmail bucket s3://BUCKET``: create the bucket unless it is there (idempotent)."""
    scheme, _, rest = args.url.partition("://")
    bucket = rest.partition("/")[0]
    if scheme.lower() not in ("s3", "s3a") or not bucket:
        raise UsageError(f"{args.url}: expected s3://bucket (a directory mailbox needs no bucket)")
    from gradientmail.mailbox.s3 import S3Mailbox
    from gradientmail.mailbox.s3_bucket import ensure_bucket

    mailbox = S3Mailbox(bucket, endpoint_url=args.endpoint_url)
    where = f" at {args.endpoint_url}" if args.endpoint_url else ""
    created = ensure_bucket(mailbox.client, bucket)
    print(f"{'created' if created else 'already there:'} bucket {bucket!r}{where}")
    return 0
