"""``open_mailbox(url)``: pick a backend from a URL, the way fsspec picks a filesystem."""

from __future__ import annotations

import os
from typing import Any

from gradientmail.mailbox.base import Mailbox
from gradientmail.mailbox.schemes import open_url
from gradientmail.mailbox.url_check import is_local_path

__all__ = [
    "open_mailbox",
]


def open_mailbox(url: str | os.PathLike[str], **options: Any) -> Mailbox:
    """Open the mailbox at ``url``; the scheme (any case) picks the backend (``registry``).

    A path or ``file:///path`` is a ``LocalMailbox``, ``memory://name`` a ``MemoryMailbox``,
    ``s3://bucket/prefix`` an ``S3Mailbox`` and any other fsspec protocol an ``FsspecMailbox``
    (refused unless its atomic create is verified). Mistyped URLs (``s3:/bucket``,
    ``file://host/run``, an unknown scheme) are refused, never turned into a local directory.

    Args:
        url: A path or URL.
        **options: For the backend: ``create=False`` (local), ``endpoint_url``, ``region_name``,
            ``retry_window``... (S3), storage options (fsspec).

    Returns:
        A mailbox that follows the ``Mailbox`` protocol.

    Raises:
        ValueError: a mistyped or unknown URL; the message shows the likely intended one.
        UnsafeStoreError: a store without an atomic create (``http(s)://``, unverified fsspec).
        MissingExtraError: the backend's extra is not installed; the message names the pip install.

    Example:
        >>> from gradientmail.mailbox import open_mailbox
        >>> box = open_mailbox("memory://doctest-open")
        >>> box
        MemoryMailbox('doctest-open')
        >>> box.put_if_absent("hello", b"world"), box.get("hello")
        (True, b'world')
        >>> open_mailbox("s3:/bucket/run")
        Traceback (most recent call last):
        ...
        ValueError: mailbox URL 's3:/bucket/run' is missing the '//' after 's3:': did you mean 's3://bucket/run'? For a local directory of that name, pass an absolute path or a str starting with './'.
    """
    path_like = isinstance(url, os.PathLike)
    if path_like:
        url = os.fspath(url)
    if not isinstance(url, str) or not url:
        raise ValueError(f"mailbox URL must be a non-empty str or path, not {url!r}")
    if is_local_path(url, path_like=path_like):  # refuses mistyped URLs (ValueError)
        from gradientmail.mailbox.local import LocalMailbox

        # "~/runs/x" is the user's home, as in a shell, not a directory named "~" here.
        return LocalMailbox(os.path.expanduser(url), **options)
    return open_url(url, **options)
