"""The mailbox a command names by its URL, opened from outside the run's training processes.

A local directory is never created unless asked, and a ``memory://`` mailbox, which no other
process can see, is refused.
"""

from __future__ import annotations

from typing import Any

from gradientmail.errors import UsageError

__all__ = ["open_cli_mailbox", "S3_READ_OPTIONS"]

S3_READ_OPTIONS: dict[str, Any] = {
    "max_attempts": 2,
    "config": {"retries": {"mode": "standard", "max_attempts": 2}, "connect_timeout": 5},
}
"""status and plot only read: an unreachable endpoint should say so in seconds, not minutes."""


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
