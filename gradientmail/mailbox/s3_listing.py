"""Listing the keys under a prefix of an S3 bucket, a page of ``LIST_PAGE`` keys per request.

Shared by ``S3Mailbox`` (boto3) and ``FsspecMailbox`` on ``s3://`` (s3fs), which differ only in
how one ``ListObjectsV2`` request is sent and retried; neither library is imported here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from gradientmail.mailbox.keys import is_valid_key, validate_prefix
from gradientmail.mailbox.wrappers import LIST_PAGE

__all__ = ["list_keys"]


def list_keys(
    fetch: Callable[[dict[str, Any]], Mapping[str, Any]],
    bucket: str,
    root: str,
    prefix: str = "",
    start_after: str | None = None,
) -> Iterator[str]:
    """Mailbox keys under ``root + prefix``, sorted, after ``start_after``; ``fetch`` sends one
    ``list_objects_v2`` request (keyword arguments as a dict) and returns the response.

    Arguments are checked when called, not on the first ``next()``. A page is requested only
    when the previous one is consumed.
    """
    validate_prefix(prefix)
    if start_after is not None and not isinstance(start_after, str):
        raise TypeError(f"start_after must be a str or None, not {type(start_after).__name__}")
    return _pages(fetch, bucket, root, root + prefix, None if start_after is None else root + start_after)


def _pages(
    fetch: Callable[[dict[str, Any]], Mapping[str, Any]], bucket: str, root: str, full_prefix: str, after: str | None
) -> Iterator[str]:
    cut = len(root)
    while True:
        request: dict[str, Any] = {"Bucket": bucket, "Prefix": full_prefix, "MaxKeys": LIST_PAGE}
        if after is not None and after >= full_prefix:
            request["StartAfter"] = after
        page = fetch(request)
        names = [entry["Key"] for entry in page.get("Contents") or ()]
        for name in names:
            key = name[cut:]
            # Folder markers and objects not written through a mailbox are not keys.
            if is_valid_key(key):
                yield key
        if not page.get("IsTruncated") or not names:
            return
        after = names[-1]
