"""The ``gradientmail`` command (also ``python -m gradientmail``): ``demo``, ``status``, ``plot``, ``tokens``.

User errors print one line, ``gradientmail: error: ...``, and exit with 1; argument errors exit
with 2. rich and matplotlib are imported only by the subcommand that needs them.

Example:
    >>> from gradientmail.cli import build_parser
    >>> build_parser().parse_args(["demo", "--nodes", "2"]).nodes
    2
"""

from gradientmail.cli.commands import (
    UNREADABLE_SHOWN,
    check_demo,
    cmd_demo,
    cmd_plot,
    cmd_status,
    status_table,
    unreadable_notes,
)
from gradientmail.cli.entry import main
from gradientmail.cli.exits import (
    DEBUG_ENV,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    PROG,
    USER_ERRORS,
    describe_error,
)
from gradientmail.cli.mailbox_url import S3_READ_OPTIONS, open_cli_mailbox
from gradientmail.cli.output import json_document
from gradientmail.cli.parser import build_parser
from gradientmail.errors import UsageError

__all__ = [
    "DEBUG_ENV",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "PROG",
    "S3_READ_OPTIONS",
    "UNREADABLE_SHOWN",
    "USER_ERRORS",
    "UsageError",
    "build_parser",
    "check_demo",
    "cmd_demo",
    "cmd_plot",
    "cmd_status",
    "describe_error",
    "json_document",
    "main",
    "open_cli_mailbox",
    "status_table",
    "unreadable_notes",
]
