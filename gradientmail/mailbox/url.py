"""``open_mailbox(url)``: pick a backend from a URL, the way fsspec picks a filesystem."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import unquote, urlsplit

from gradientmail.errors import MissingExtraError
from gradientmail.mailbox.base import Mailbox


def open_mailbox(url: str | os.PathLike[str], **options: Any) -> Mailbox:
    """Open the mailbox at ``url``.

    - ``/path``, ``./path`` or ``file:///path`` → ``LocalMailbox`` (``create=False`` refuses a
      missing directory instead of creating it)
    - ``memory://name`` → ``MemoryMailbox``
    - ``s3://bucket/prefix`` → ``S3Mailbox``; ``options`` such as ``endpoint_url``,
      ``region_name`` or ``profile_name`` go to boto3 (``AWS_ENDPOINT_URL`` is honoured)
    - any other fsspec protocol → ``FsspecMailbox``, which refuses filesystems without a
      verified atomic create
    """
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url:
        raise ValueError(f"mailbox URL must be a non-empty str or path, not {url!r}")
    scheme, sep, rest = url.partition("://")
    if not sep:
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
            raise MissingExtraError(
                f"{url}: S3 mailboxes need boto3: pip install 'gradientmail[s3]' ({exc})"
            ) from exc
        bucket, _, prefix = rest.partition("/")
        return S3Mailbox(bucket, prefix, **options)
    try:
        from gradientmail.mailbox.filesystem import FsspecMailbox
    except ImportError as exc:
        raise MissingExtraError(
            f"{url}: fsspec mailboxes need fsspec: pip install 'gradientmail[fsspec]' ({exc})"
        ) from exc
    return FsspecMailbox.from_url(url, **options)
