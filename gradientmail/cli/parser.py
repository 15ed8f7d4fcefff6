"""The ``gradientmail`` argument parser: subcommands, their options and the option types."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from gradientmail.cli.commands import check_demo, cmd_bucket, cmd_demo, cmd_plot, cmd_status
from gradientmail.cli.exits import DEBUG_ENV, PROG
from gradientmail.cli.tokens import add_tokens_command


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, not {value}")
    return value


def _positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def _non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text}")
    return value


def _speeds(text: str) -> tuple[float, ...]:
    parts = text.replace(",", ":").split(":")
    try:
        return tuple(_positive_float(part) for part in parts)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"speeds are positive numbers separated by ':' (like 1:2:2:4), not {text!r}"
        ) from None


def _slowdown(text: str) -> tuple[str, float]:
    node, sep, factor = text.rpartition(":")
    if not sep or not node:
        raise argparse.ArgumentTypeError(f"expected NODE:FACTOR (like A:4), not {text!r}")
    return node, _positive_float(factor)


def _add_store_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--endpoint-url",
        metavar="URL",
        default=None,
        help="S3-compatible endpoint for s3:// mailboxes (default: AWS_ENDPOINT_URL or AWS)",
    )


def _version() -> str:
    """The installed distribution's version (the package's own when not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gradientmail")
    except PackageNotFoundError:
        from gradientmail import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    """The ``gradientmail`` parser: each subcommand sets ``func`` (and ``check``) on its namespace.

    Example:
        >>> args = build_parser().parse_args(["status", "runs/exp-1", "--json"])
        >>> args.command, args.url, args.json, args.threads
        ('status', 'runs/exp-1', True, None)
    """
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Train one model on machines of unequal speed through a shared mailbox.",
        epilog="Run 'gradientmail demo' to see four nodes of speeds 1:2:2:4 share 24 units.",
    )
    parser.add_argument(
        "--debug", action="store_true", help=f"show tracebacks instead of one-line errors (or {DEBUG_ENV}=1)"
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add_command in COMMANDS:
        add_command(commands)
    return parser


def add_demo_command(commands: Any) -> argparse.ArgumentParser:
    """``gradientmail demo``."""
    demo = commands.add_parser(
        "demo",
        help="run nodes of unequal speed on one mailbox and compare with a fixed split",
        description=(
            "Start N node processes of unequal speed. Each runs the documented loop "
            "(shared_queue + Session) on a small model and a synthetic dataset, on one mailbox. "
            "Shows live progress per node, then a summary (units, samples, makespan beside the "
            "fixed split computed for the same speeds, final loss) and writes a Gantt chart."
        ),
    )
    demo.add_argument("--nodes", type=_positive_int, default=4, metavar="N", help="node processes to start (default 4)")
    demo.add_argument(
        "--speeds",
        type=_speeds,
        default=None,
        metavar="T1:T2:...",
        help="relative time per batch of each node, larger = slower (default 1:2:2:4, repeated for more nodes)",
    )
    demo.add_argument(
        "--units",
        type=_positive_int,
        default=24,
        metavar="U",
        help="work units in the run, a multiple of --nodes (default 24)",
    )
    demo.add_argument("--unit-steps", type=_positive_int, default=4, metavar="S", help="batches per unit (default 4)")
    demo.add_argument(
        "--batch-time",
        type=_positive_float,
        default=0.1,
        metavar="SECONDS",
        help="seconds per batch at relative time 1 (default 0.1)",
    )
    demo.add_argument(
        "--slowdown",
        type=_slowdown,
        default=None,
        metavar="NODE:FACTOR",
        help="make NODE (a name like A, or an index from 0) FACTOR times slower from --slowdown-at on",
    )
    demo.add_argument(
        "--slowdown-at",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="when the slowdown starts (default: half the ideal shared-queue time)",
    )
    demo.add_argument(
        "--prefetch", type=_positive_int, default=2, metavar="B", help="batches each node loads ahead (default 2)"
    )
    demo.add_argument(
        "--mailbox",
        default=None,
        metavar="URL",
        help="run on this mailbox, a directory or s3://bucket/prefix, which must "
        "not hold a run yet (default: OUT/mailbox)",
    )
    _add_store_options(demo)
    demo.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="directory for the mailbox, chart and summary (default: a new temporary directory)",
    )
    demo.add_argument(
        "--gantt", default=None, metavar="PNG", help="where to write the Gantt chart (default OUT/gantt.png)"
    )
    demo.add_argument(
        "--summary",
        default=None,
        metavar="PATH",
        dest="summary_json",
        help="where to write the summary as JSON (default OUT/summary.json)",
    )
    demo.add_argument("--seed", type=_non_negative_int, default=0, help="random seed (default 0)")
    demo.set_defaults(func=cmd_demo, check=check_demo, subparser=demo)
    return demo


def add_status_command(commands: Any) -> argparse.ArgumentParser:
    """``gradientmail status``."""
    status = commands.add_parser(
        "status",
        help="show the run in a mailbox: units, samples and last seen per learner",
        description=(
            "Show each learner's units claimed, samples, samples/s and last seen, and units "
            "claimed/total when run.json gives the total. Cost: lists units/ and progress/, "
            "then one GET per claim body (--threads in parallel; 800 units = 800 GETs), "
            "and one per progress record; --watch fetches only new claims afterwards."
        ),
        epilog=(
            "--json keys: mailbox, read_at, created, units_total (null if unknown), "
            "units_claimed, learners: [{learner, units, samples, samples_per_s, steps, started, "
            "last_seen, finished}] (times are unix seconds; null when not reported)."
        ),
    )
    status.add_argument("url", metavar="URL", help="the mailbox: a directory or s3://bucket/prefix")
    status.add_argument("--json", action="store_true", help="print JSON for scripts")
    status.add_argument(
        "--watch",
        action="store_true",
        help="refresh every --interval seconds until Ctrl-C (with --json: one JSON document per line)",
    )
    status.add_argument(
        "--interval",
        type=_positive_float,
        default=2.0,
        metavar="SECONDS",
        help="refresh interval for --watch (default 2)",
    )
    status.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        metavar="N",
        help="parallel GETs for claim bodies (default 16; 1 for a directory)",
    )
    _add_store_options(status)
    status.set_defaults(func=cmd_status)
    return status


def add_plot_command(commands: Any) -> argparse.ArgumentParser:
    """``gradientmail plot``."""
    plot = commands.add_parser(
        "plot",
        help="write the Gantt chart of a run (learner x time, one bar per unit)",
        description=(
            "Write a Gantt chart of the run in a mailbox: one row per learner, one bar per "
            "unit from its first batch to its last (progress records), else from its claim to "
            "the next claim by the same thread; beyond 500 units each row shows the learner's "
            "busy time, its units merged. Reads every claim body like status."
        ),
    )
    plot.add_argument("url", metavar="URL", help="the mailbox: a directory or s3://bucket/prefix")
    plot.add_argument("-o", "--output", default="gantt.png", metavar="PNG", help="output PNG (default gantt.png)")
    plot.add_argument("--title", default=None, help="chart title (default: the mailbox URL)")
    plot.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        metavar="N",
        help="parallel GETs for claim bodies (default 16; 1 for a directory)",
    )
    _add_store_options(plot)
    plot.set_defaults(func=cmd_plot)
    return plot


def add_bucket_command(commands: Any) -> argparse.ArgumentParser:
    """``gradientmail bucket``."""
    bucket = commands.add_parser(
        "bucket",
        help="create an S3 bucket for runs unless it exists (safe to run again, on every machine)",
        description=(
            "Create the bucket of s3://BUCKET[/prefix] unless it is there already; a second run, or "
            "two machines at once, is not an error. Credentials and endpoint as for status."
        ),
    )
    bucket.add_argument("url", metavar="URL", help="s3://bucket (a prefix after it is ignored)")
    _add_store_options(bucket)
    bucket.set_defaults(func=cmd_bucket)
    return bucket


COMMANDS: tuple[Callable[[Any], argparse.ArgumentParser], ...] = (
    add_demo_command,
    add_status_command,
    add_plot_command,
    add_bucket_command,
    add_tokens_command,
)
"""Every subcommand, one way: a function that adds its parser to ``commands`` and sets ``func``
(and ``check``) on its namespace; a new command is one more such function here."""
