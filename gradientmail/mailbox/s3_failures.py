"""What a failed S3 request means: its outcome for the operation, and a final failure explained.

``outcome`` sorts a botocore error into what ``S3Mailbox`` does next (the key exists or is
missing, retry, refuse); ``explain_failure`` says in one line what went wrong and what to check
(credentials, the bucket, the region, the endpoint), naming the operating system's reason under
a connection error (``root_cause``).
"""

from __future__ import annotations

import collections
from typing import Any

import botocore.exceptions

from gradientmail.mailbox.s3_common import (
    CONFLICT_CODES,
    CREDENTIAL_CODES,
    REGION_CODES,
    TRANSIENT_CODES,
    error_fields,
)

__all__ = [
    "CONFLICT",
    "CONNECT_ERRORS",
    "CREDENTIAL_ERRORS",
    "denied",
    "EXISTS",
    "explain_failure",
    "FATAL",
    "MISSING",
    "outcome",
    "REQUEST_ERRORS",
    "root_cause",
    "TRANSIENT",
    "TRANSPORT_ERRORS",
    "UNSUPPORTED",
]


# Outcomes of a failed request, as S3Mailbox acts on them.
EXISTS, MISSING, CONFLICT, TRANSIENT, UNSUPPORTED, FATAL = (
    "exists",
    "missing",
    "conflict",
    "transient",
    "unsupported",
    "fatal",
)

TRANSPORT_ERRORS = (
    botocore.exceptions.ConnectionError,  # includes connect timeouts and unreachable endpoints
    botocore.exceptions.HTTPClientError,  # read timeouts, closed connections, broken streams
    botocore.exceptions.IncompleteReadError,
)
CREDENTIAL_ERRORS = (
    botocore.exceptions.NoCredentialsError,
    botocore.exceptions.PartialCredentialsError,
    botocore.exceptions.CredentialRetrievalError,
    botocore.exceptions.ProfileNotFound,
)
REQUEST_ERRORS = (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError)

CONNECT_ERRORS = (
    botocore.exceptions.EndpointConnectionError,  # refused, no route, unknown host
    botocore.exceptions.ConnectTimeoutError,
    botocore.exceptions.ProxyConnectionError,
)
"""No connection could be made: the request never reached the store."""


def outcome(exc: BaseException) -> str:
    """What a failed request means for the operation: one of ``EXISTS`` ... ``FATAL``."""
    if isinstance(exc, TRANSPORT_ERRORS):
        return TRANSIENT
    if not isinstance(exc, botocore.exceptions.ClientError):
        return FATAL
    code, status, _ = error_fields(exc)
    message = str((exc.response.get("Error") or {}).get("Message") or "")
    if code == "PreconditionFailed" or status == 412:
        return EXISTS
    if code in ("NoSuchKey", "NotFound", "404") and status == 404:
        return MISSING
    if code in CONFLICT_CODES:
        return CONFLICT
    if code == "NotImplemented" or status == 501 or (status == 400 and "if-none-match" in message.lower()):
        return UNSUPPORTED
    if code in TRANSIENT_CODES or status == 429 or status >= 500:
        return TRANSIENT
    return FATAL


def explain_failure(
    exc: BaseException,
    *,
    bucket: str,
    endpoint: str,
    limits: str,
    first_contact: bool,
    bucket_missing: bool = False,
) -> str:
    """``"<code>: <message> (<likely cause and what to check>)"`` for a final failure.

    ``bucket_missing``: a probe found no such bucket (some stores answer 403 for a missing
    bucket, which would otherwise read as rejected credentials).
    """
    code, status, _ = error_fields(exc)
    if isinstance(exc, botocore.exceptions.ClientError):
        detail = f"{code or status}: {(exc.response.get('Error') or {}).get('Message', '')}"
    else:
        detail = f"{type(exc).__name__}: {exc}"
    if bucket_missing:
        code = "NoSuchBucket"
    return f"{detail} ({_cause(exc, code, status, bucket, endpoint, limits, first_contact)})"


def denied(exc: BaseException) -> bool:
    """Whether ``exc`` is a refusal (403, AccessDenied and kin) that may hide a missing bucket."""
    code, status, _ = error_fields(exc)
    return isinstance(exc, botocore.exceptions.ClientError) and (code in CREDENTIAL_CODES or status == 403)


def _cause(
    exc: BaseException, code: str, status: int, bucket: str, endpoint: str, limits: str, first_contact: bool
) -> str:
    if isinstance(exc, CREDENTIAL_ERRORS):
        compatible = endpoint.startswith(("http://", "https://")) and "amazonaws.com" not in endpoint
        return (
            "no usable AWS credentials: boto3 looks at AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or profile_name, ~/.aws/credentials and "
            "instance or container roles"
            + (
                f"; an S3-compatible store ({endpoint}) needs them too: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY to its keys (any non-empty values for a store without "
                "authentication)"
                if compatible
                else ""
            )
        )
    if code == "NoSuchBucket":
        return (
            f"bucket {bucket!r} does not exist at this endpoint: create it, or check "
            "the name, endpoint_url / AWS_ENDPOINT_URL and region"
        )
    if code in CREDENTIAL_CODES or status == 403:
        return (
            "the credentials were rejected or lack permission (s3:GetObject, s3:PutObject, "
            "s3:DeleteObject and s3:ListBucket on this bucket and prefix are needed)"
        )
    if code in REGION_CODES:
        return "the bucket lives in another region: pass region_name or set AWS_REGION"
    if first_contact:
        reason = root_cause(exc) or type(exc).__name__
        return (
            f"endpoint {endpoint} is unreachable ({reason}) and has never answered: check "
            "endpoint_url / AWS_ENDPOINT_URL, that the store is running, and the network"
        )
    if isinstance(exc, TRANSPORT_ERRORS):
        reason = root_cause(exc) or type(exc).__name__
        return (
            f"endpoint {endpoint} is unreachable or breaking connections ({reason}), for "
            f"longer than the retries allow ({limits}): the store or the network "
            "is down; a longer retry_window rides out longer outages"
        )
    if outcome(exc) in (TRANSIENT, CONFLICT):
        return (
            "the store kept failing (throttling, server errors or timeouts) for longer "
            f"than the retries allow ({limits}); retry later or raise retry_window"
        )
    return "unexpected answer from the store"


def root_cause(exc: BaseException) -> str:
    """The operating-system reason under a connection error (``Connection refused``), or ""."""
    seen: set[int] = set()
    fallback = ""
    pending: collections.deque[Any] = collections.deque([exc])
    while pending:
        current = pending.popleft()
        if not isinstance(current, BaseException) or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.strerror:
            return str(current.strerror)
        if isinstance(current, OSError) and not fallback:
            fallback = str(current)  # e.g. http.client's RemoteDisconnected, without strerror
        kwargs = getattr(current, "kwargs", None)  # botocore keeps the urllib3 error here
        if isinstance(kwargs, dict):
            pending.append(kwargs.get("error"))
        pending += [getattr(current, "reason", None), current.__cause__, current.__context__]
        pending += current.args  # urllib3's ProtocolError carries the socket error as an arg
    return fallback
