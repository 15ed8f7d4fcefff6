"""How a command ends: its exit code, and a user error said in one line on stderr.

``--debug`` (or ``GRADIENTMAIL_DEBUG=1``) shows the traceback instead of the line.
"""

from __future__ import annotations

import sys

from gradientmail.errors import GradientMailError

__all__ = [
    "DEBUG_ENV",
    "describe_error",
    "EXIT_BROKEN_PIPE",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "fail",
    "is_store_error",
    "PROG",
    "USER_ERRORS",
]

PROG = "gradientmail"
"""The program's name, which begins every error line."""
DEBUG_ENV = "GRADIENTMAIL_DEBUG"
"""Set to anything but ``0``: tracebacks instead of one-line errors, as ``--debug``."""
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141
"""128 + SIGPIPE: what a shell reports for a program whose reader left."""

USER_ERRORS = (GradientMailError, OSError, ValueError, LookupError, ImportError, TimeoutError)
"""Errors shown as one line (``--debug`` shows the traceback instead)."""


def is_store_error(exc: BaseException) -> bool:
    """Whether ``exc`` comes from a storage client (botocore, s3fs, aiohttp), without importing one."""
    for cls in type(exc).__mro__:
        if cls.__module__.split(".")[0] in ("botocore", "boto3", "s3fs", "aiohttp", "urllib3"):
            return True
    return False


def describe_error(exc: BaseException) -> str:
    """One line saying what went wrong, with a hint for the usual causes.

    Example:
        >>> describe_error(FileNotFoundError("runs/x"))
        'not found: runs/x'
    """
    message = " ".join(str(exc).split()) or type(exc).__name__
    name = type(exc).__name__
    if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
        message += " (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, for this S3 mailbox)"
    elif name == "EndpointConnectionError" or isinstance(exc, ConnectionError):
        message += " (is the endpoint URL right and the store reachable?)"
    elif isinstance(exc, FileNotFoundError) and not message.startswith("no mailbox"):
        message = f"not found: {message}"
    return message


def fail(message: str) -> int:
    """Print ``gradientmail: error: MESSAGE`` on stderr; returns the exit code 1."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return EXIT_ERROR
