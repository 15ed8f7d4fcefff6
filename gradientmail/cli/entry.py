"""``main``: parse, run the subcommand, turn user errors into one line and an exit code."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from gradientmail.cli.exits import (
    DEBUG_ENV,
    EXIT_BROKEN_PIPE,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    PROG,
    USER_ERRORS,
    describe_error,
    fail,
    is_store_error,
)
from gradientmail.cli.parser import build_parser
from gradientmail.errors import GradientMailError


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``gradientmail ARGS``; returns the exit code (0, 1 user error, 2 usage, 130 Ctrl-C,
    141 when the reader of its output left, as a shell's pipeline says).

    Args:
        argv: The arguments after the program name; ``sys.argv[1:]`` when None.

    Returns:
        The exit code. ``--debug`` (or ``GRADIENTMAIL_DEBUG=1``) raises instead of printing one line.

    Example:
        >>> main(["status", "/no/such/run"])  # prints "gradientmail: error: ..." on stderr
        1
    """
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
    except BrokenPipeError:
        # The reader of our output left (`gradientmail status --json | head -1`): not an error
        # of the store. Point stdout at nothing so the interpreter's final flush stays quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if debug or not (isinstance(exc, USER_ERRORS) or is_store_error(exc)):
            raise
        return fail(describe_error(exc))


def tokens_main(argv: Sequence[str] | None = None) -> int:
    """``python -m gradientmail.data ARGS``: the same as ``gradientmail tokens ARGS``."""
    return main(["tokens", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
