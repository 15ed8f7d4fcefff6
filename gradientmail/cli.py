"""The ``gradientmail`` command: ``demo``, ``status``, ``plot``, ``tokens``; also ``python -m gradientmail``.

User errors (a missing mailbox, an empty run, an unknown URL scheme, missing credentials, an
unreachable store) print one line, ``gradientmail: error: ...``, on stderr and exit with 1;
argument errors exit with 2 (argparse). ``--debug`` (or ``GRADIENTMAIL_DEBUG=1``) shows the
traceback instead. rich and matplotlib are imported only by the subcommand that needs them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from gradientmail.errors import GradientMailError, MissingExtraError

PROG = "gradientmail"
DEBUG_ENV = "GRADIENTMAIL_DEBUG"
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

LOCAL_SCHEMES = ("file",)
S3_SCHEMES = ("s3", "s3a")

S3_READ_OPTIONS: dict[str, Any] = {
    "max_attempts": 2,
    "config": {"retries": {"mode": "standard", "max_attempts": 2}, "connect_timeout": 5},
}
"""status and plot only read: an unreachable endpoint should say so in seconds, not minutes."""


class UsageError(GradientMailError, ValueError):
    """A mailbox URL or option the command cannot work with."""


# -- mailboxes ------------------------------------------------------------------------------
def _known_fsspec_protocol(scheme: str) -> bool:
    try:
        from fsspec.registry import known_implementations, registry
    except ImportError:
        return False
    return scheme in known_implementations or scheme in registry


def open_cli_mailbox(
    url: str, *, endpoint_url: str | None = None, create: bool = False, s3_options: dict[str, Any] | None = None
):
    """Open ``url`` for a command; a local directory is never created unless ``create``."""
    from gradientmail.mailbox import open_mailbox

    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower() if sep else ""
    if not sep or scheme in LOCAL_SCHEMES:
        if endpoint_url:
            raise UsageError(f"--endpoint-url applies to s3:// mailboxes, not {url!r}")
        return open_mailbox(url, create=create)
    if scheme == "memory":
        raise UsageError(
            f"{url}: a memory:// mailbox lives inside one Python process, so no command can "
            "see it from outside; use a directory or s3://bucket/prefix"
        )
    if scheme in S3_SCHEMES:
        if not rest.partition("/")[0]:
            raise UsageError(f"{url}: an S3 mailbox URL names a bucket: s3://bucket/prefix")
        options = dict(s3_options or {})
        if endpoint_url:
            options["endpoint_url"] = endpoint_url
        return open_mailbox(url, **options)
    if endpoint_url:
        raise UsageError(f"--endpoint-url applies to s3:// mailboxes, not {url!r}")
    if not _known_fsspec_protocol(scheme):
        raise UsageError(
            f"unknown mailbox URL scheme {scheme!r} in {url!r}: use a directory path, "
            "file:///path, s3://bucket/prefix or a protocol fsspec knows"
        )
    return open_mailbox(url)


# -- error reporting ------------------------------------------------------------------------
def _is_store_error(exc: BaseException) -> bool:
    """Errors of the storage clients (botocore, s3fs, aiohttp), matched without importing them."""
    for cls in type(exc).__mro__:
        if cls.__module__.split(".")[0] in ("botocore", "boto3", "s3fs", "aiohttp", "urllib3"):
            return True
    return False


USER_ERRORS = (GradientMailError, OSError, ValueError, LookupError, ImportError, TimeoutError)


def describe_error(exc: BaseException) -> str:
    """One line saying what went wrong, with a hint for the usual causes."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    name = type(exc).__name__
    if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
        message += " (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, for this S3 mailbox)"
    elif name == "EndpointConnectionError" or isinstance(exc, ConnectionError):
        message += " (is the endpoint URL right and the store reachable?)"
    elif isinstance(exc, FileNotFoundError) and not message.startswith("no mailbox"):
        message = f"not found: {message}"
    return message


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return EXIT_ERROR


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


def json_document(value: Any, **options: Any) -> str:
    """``value`` as strict JSON: a non-finite float (no record should hold one) becomes null."""
    return json.dumps(_finite(value), allow_nan=False, **options)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def _console():
    try:
        from rich.console import Console
    except ImportError as exc:
        raise MissingExtraError(f"this command needs rich: pip install 'gradientmail[cli]' ({exc})") from exc
    return Console()


# -- commands -------------------------------------------------------------------------------
def cmd_status(args: argparse.Namespace) -> int:
    from gradientmail.status import RunReader, require_run

    mailbox = open_cli_mailbox(args.url, endpoint_url=args.endpoint_url, s3_options=S3_READ_OPTIONS)
    reader = RunReader(mailbox, threads=args.threads)
    if not args.watch:
        run = require_run(reader.read())
        if args.json:
            print(json_document(run.to_dict(), indent=2))
        else:
            _console().print(status_table(run))
        return 0

    # --watch: refresh until Ctrl-C; an empty run is shown as such (it may not have started).
    try:
        if args.json:
            while True:
                print(json_document(reader.read().to_dict()), flush=True)
                time.sleep(args.interval)
        console = _console()
        if not console.is_terminal:
            while True:
                console.print(status_table(reader.read()))
                console.file.flush()
                time.sleep(args.interval)
        from rich.live import Live

        with Live(status_table(reader.read()), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(args.interval)
                live.update(status_table(reader.read()), refresh=True)
    except KeyboardInterrupt:
        return 0


def cmd_plot(args: argparse.Namespace) -> int:
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
    """Options that parse but do not describe a run are argument errors too (exit 2)."""
    from gradientmail.demo import make_plan

    args.plan = make_plan(args)


def cmd_demo(args: argparse.Namespace) -> int:
    from gradientmail.demo import run_demo

    return run_demo(args)


# -- parser ---------------------------------------------------------------------------------
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
        "--threads", type=_positive_int, default=16, metavar="N", help="parallel GETs for claim bodies (default 16)"
    )
    _add_store_options(status)
    status.set_defaults(func=cmd_status)

    plot = commands.add_parser(
        "plot",
        help="write the Gantt chart of a run (learner x time, one bar per unit)",
        description=(
            "Write a Gantt chart of the run in a mailbox: one row per learner, one bar per "
            "unit from its claim to the next claim by the same thread (a learner's last unit "
            "ends at its progress record's last_seen). Reads every claim body like status."
        ),
    )
    plot.add_argument("url", metavar="URL", help="the mailbox: a directory or s3://bucket/prefix")
    plot.add_argument("-o", "--output", default="gantt.png", metavar="PNG", help="output PNG (default gantt.png)")
    plot.add_argument("--title", default=None, help="chart title (default: the mailbox URL)")
    plot.add_argument(
        "--threads", type=_positive_int, default=16, metavar="N", help="parallel GETs for claim bodies (default 16)"
    )
    _add_store_options(plot)
    plot.set_defaults(func=cmd_plot)

    from gradientmail.data.cli import add_tokens_command  # gradientmail tokens write|stdlib

    add_tokens_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    check = getattr(args, "check", None)
    if check is not None:
        try:
            check(args)
        except GradientMailError as exc:
            args.subparser.error(str(exc))
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if debug or not (isinstance(exc, USER_ERRORS) or _is_store_error(exc)):
            raise
        return _fail(describe_error(exc))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
