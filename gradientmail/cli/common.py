"""Helpers every command shares: opening a mailbox, one-line errors, the console, strict JSON."""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from gradientmail.errors import GradientMailError, MissingExtraError, UsageError

PROG = "gradientmail"
DEBUG_ENV = "GRADIENTMAIL_DEBUG"
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141
"""128 + SIGPIPE: what a shell reports for a program whose reader left."""

S3_READ_OPTIONS: dict[str, Any] = {
    "max_attempts": 2,
    "config": {"retries": {"mode": "standard", "max_attempts": 2}, "connect_timeout": 5},
}
"""status and plot only read: an unreachable endpoint should say so in seconds, not minutes."""

USER_ERRORS = (GradientMailError, OSError, ValueError, LookupError, ImportError, TimeoutError)
"""Errors shown as one line (``--debug`` shows the traceback instead)."""


# -- mailboxes ------------------------------------------------------------------------------
def open_cli_mailbox(
    url: str, *, endpoint_url: str | None = None, create: bool = False, s3_options: dict[str, Any] | None = None
):
    """Open ``url`` for a command; a local directory is never created unless ``create``."""
    from gradientmail.mailbox import open_mailbox
    from gradientmail.mailbox.schemes import SCHEMES, backend_for

    scheme, sep, rest = url.partition("://")
    backend = backend_for(scheme) if sep else SCHEMES["file"]
    if backend is not None and not backend.shared:
        raise UsageError(
            f"{url}: a {scheme.lower()}:// mailbox lives inside one Python process, so no command "
            "can see it from outside; use a directory or s3://bucket/prefix"
        )
    if endpoint_url and not (backend is not None and backend.endpoint):
        raise UsageError(f"--endpoint-url applies to s3:// mailboxes, not {url!r}")
    if backend is None:
        raise UsageError(
            f"unknown mailbox URL scheme {scheme.lower()!r} in {url!r}: use a directory path, "
            "file:///path, s3://bucket/prefix or a protocol fsspec knows"
        )
    if backend.local:
        return open_mailbox(url, create=create)
    if backend.endpoint:
        if not rest.partition("/")[0]:
            raise UsageError(f"{url}: an S3 mailbox URL names a bucket: s3://bucket/prefix")
        options = dict(s3_options or {})
        if endpoint_url:
            options["endpoint_url"] = endpoint_url
        return open_mailbox(url, **options)
    return open_mailbox(url)


# -- error reporting ------------------------------------------------------------------------
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


# -- output ---------------------------------------------------------------------------------
def json_document(value: Any, **options: Any) -> str:
    """``value`` as strict JSON: a non-finite float (no record should hold one) becomes null.

    Example:
        >>> json_document({"rate": float("nan"), "units": [1, 2]})
        '{"rate": null, "units": [1, 2]}'
    """
    return json.dumps(_finite(value), allow_nan=False, **options)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def console():
    """A rich ``Console``; ``MissingExtraError`` with the install hint when rich is missing."""
    try:
        from rich.console import Console
    except ImportError as exc:
        raise MissingExtraError(f"this command needs rich: pip install 'gradientmail[cli]' ({exc})") from exc
    return Console()
