"""What the boto3 (``S3Mailbox``) and s3fs (``FsspecMailbox`` on ``s3://``) backends share.

The creation-token metadata name, S3 error codes and how to read them, bounded reads' ranges and
sizes, and key listing. Neither
boto3 nor s3fs is imported here: the two differ only in how one request is sent and retried.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from gradientmail.mailbox.base import LIST_PAGE
from gradientmail.mailbox.keys import is_valid_key, validate_prefix

__all__ = [
    "CONFLICT_CODES",
    "CREDENTIAL_CODES",
    "EMPTY_RANGE_CODE",
    "REGION_CODES",
    "TOKEN_METADATA",
    "TRANSIENT_CODES",
    "error_code",
    "error_fields",
    "first_bytes",
    "list_keys",
    "stored_size",
]

TOKEN_METADATA = "gm-token"
"""User-metadata name of the per-call creation token (sent as ``x-amz-meta-gm-token``).

A write whose answer was lost is retried and then meets its own object; the token read back with
one ``HeadObject`` tells "this call created it" from "someone else did".
"""

TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "TooManyRequests",
        "RequestLimitExceeded",
        "RequestThrottled",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "PriorRequestNotComplete",
        "BadDigest",
    }
)
"""Error codes worth retrying: throttling and server-side failures."""

CONFLICT_CODES = frozenset({"ConditionalRequestConflict", "OperationAborted"})
"""A concurrent conditional write is in progress (409): retry."""

CREDENTIAL_CODES = frozenset(
    {
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AllAccessDisabled",
    }
)
"""The credentials were rejected or lack permission."""

REGION_CODES = frozenset({"PermanentRedirect", "AuthorizationHeaderMalformed", "IllegalLocationConstraintException"})
"""The bucket lives in another region."""


EMPTY_RANGE_CODE = "InvalidRange"
"""The answer (416) to a ranged GET of an empty object: it has no byte 0 to start the range at."""


def first_bytes(count: int) -> str:
    """The ``Range`` header asking for the first ``count`` bytes of an object (``count >= 1``).

    Example:
        >>> first_bytes(65537)
        'bytes=0-65536'
    """
    return f"bytes=0-{count - 1}"


def stored_size(response: Mapping[str, Any]) -> int | None:
    """The whole object's size from a ``GetObject`` answer, or None when it does not say.

    A ranged answer (206) names it after the ``/`` of ``Content-Range``; a store that ignored the
    range sends the whole object, whose ``Content-Length`` is the size.

    Example:
        >>> stored_size({"ContentRange": "bytes 0-65536/1073741824", "ContentLength": 65537})
        1073741824
        >>> stored_size({"ContentLength": 12}), stored_size({"ContentRange": "bytes 0-9/*"})
        (12, None)
    """
    content_range = response.get("ContentRange")
    if content_range:
        total = str(content_range).rpartition("/")[2].strip()
        return int(total) if total.isdigit() else None
    length = response.get("ContentLength")
    return length if isinstance(length, int) and not isinstance(length, bool) else None


def error_fields(exc: BaseException) -> tuple[str, int, int]:
    """``(error code, HTTP status, retries the client already made)`` of a botocore error."""
    response = getattr(exc, "response", None) or {}
    metadata = response.get("ResponseMetadata") or {}
    code = str((response.get("Error") or {}).get("Code") or "")
    return code, int(metadata.get("HTTPStatusCode") or 0), int(metadata.get("RetryAttempts") or 0)


def error_code(exc: BaseException) -> str:
    """The S3 error code behind ``exc`` or the errors that caused it (s3fs wraps them), or ''."""
    seen = exc
    for _ in range(4):
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            return str((response.get("Error") or {}).get("Code") or "")
        if seen.__cause__ is None:
            break
        seen = seen.__cause__
    return ""


def list_keys(
    fetch: Callable[[dict[str, Any]], Mapping[str, Any]],
    bucket: str,
    root: str,
    prefix: str = "",
    start_after: str | None = None,
) -> Iterator[str]:
    """Mailbox keys under ``root + prefix``, sorted, after ``start_after``, lazily.

    Args:
        fetch: Sends one ``list_objects_v2`` request (its keyword arguments as a dict) and
            returns the response; called again only when the previous page is consumed.
        bucket: The bucket.
        root: The mailbox's run prefix in the bucket (empty or ending with ``/``).
        prefix: The ``Mailbox.list`` prefix, relative to ``root``.
        start_after: Skip keys ``<=`` it.

    Raises:
        InvalidKeyError: ``prefix`` is not a valid prefix (checked at the call).
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
