"""``open_mailbox(url)``: pick a backend from a URL, the way fsspec picks a filesystem."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import unquote, urlsplit

from gradientmail.errors import MissingExtraError, UnsafeStoreError
from gradientmail.mailbox.base import Mailbox
from gradientmail.mailbox.url_check import is_local_path


def open_mailbox(url: str | os.PathLike[str], **options: Any) -> Mailbox:
    """Open the mailbox at ``url``.

    - ``/path``, ``./path`` or ``file:///path`` → ``LocalMailbox`` (``create=False`` refuses a
      missing directory instead of creating it)
    - schemes are case-insensitive; a mistyped URL (``s3:/bucket``, ``file://host/run``, an
      unknown scheme) is refused with ``ValueError`` showing the likely intended one
    - ``memory://name`` → ``MemoryMailbox``
    - ``s3://bucket/prefix`` → ``S3Mailbox``; ``options`` such as ``endpoint_url``,
      ``region_name`` or ``profile_name`` go to boto3 (``AWS_ENDPOINT_URL`` is honoured), and
      ``retry_window`` (a ``timedelta``) bounds how long an operation rides out an outage
    - ``http://`` and ``https://`` are refused: a web server has no atomic create; an
      S3-compatible store at that address is ``s3://bucket/prefix`` with ``endpoint_url``
    - any other fsspec protocol → ``FsspecMailbox``, which refuses filesystems without a
      verified atomic create
    """
    path_like = isinstance(url, os.PathLike)
    if path_like:
        url = os.fspath(url)
    if not isinstance(url, str) or not url:
        raise ValueError(f"mailbox URL must be a non-empty str or path, not {url!r}")
    local = is_local_path(url, path_like=path_like)  # refuses mistyped URLs (ValueError)
    scheme, sep, rest = url.partition("://")
    if local:
        from gradientmail.mailbox.local import LocalMailbox

        return LocalMailbox(url, **options)
    scheme = scheme.lower()
    if scheme == "file":
        from gradientmail.mailbox.local import LocalMailbox

        return LocalMailbox(unquote(urlsplit(url).path), **options)
    if scheme == "memory":
        from gradientmail.mailbox.memory import MemoryMailbox

        if options:
            raise TypeError(f"memory:// mailboxes take no options, got {sorted(options)}")
        return MemoryMailbox(rest.strip("/") or "default")
    if scheme in ("s3", "s3a"):
        try:
            from gradientmail.mailbox.s3 import S3Mailbox
        except ImportError as exc:
            raise MissingExtraError(f"{url}: S3 mailboxes need boto3: pip install 'gradientmail[s3]' ({exc})") from exc
        bucket, _, prefix = rest.partition("/")
        return S3Mailbox(bucket, prefix, **options)
    if scheme in ("http", "https"):
        raise _web_url_error(url, scheme, rest)
    try:
        from gradientmail.mailbox.filesystem import FsspecMailbox
    except ImportError as exc:
        raise MissingExtraError(
            f"{url}: fsspec mailboxes need fsspec: pip install 'gradientmail[fsspec]' ({exc})"
        ) from exc
    return FsspecMailbox.from_url(url, **options)


def _web_url_error(url: str, scheme: str, rest: str) -> UnsafeStoreError:
    """Why an ``http(s)://`` URL is no mailbox, and the ``s3://`` call that was likely meant."""
    host, _, path = rest.partition("/")
    bucket, _, prefix = path.strip("/").partition("/")
    target = f"s3://{bucket or 'BUCKET'}/{prefix or 'PREFIX'}"
    return UnsafeStoreError(
        f"{url}: cannot use an {scheme}:// URL as a mailbox: GradientMail has not verified an "
        "atomic create for a web server (fsspec's HTTPFileSystem has none), so two nodes could "
        "claim the same unit. For an S3-compatible store at this address use "
        f"open_mailbox({target!r}, endpoint_url={f'{scheme}://{host}'!r})",
        operation="open",
        store=url,
    )
