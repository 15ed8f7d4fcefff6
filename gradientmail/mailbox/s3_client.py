"""The boto3 side of ``S3Mailbox``: making a client, and classifying and explaining failures.

Kept apart from ``s3.py`` so that the backend reads as the five operations and their retries.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import boto3
import botocore.config
import botocore.exceptions
import botocore.loaders
import botocore.session

from gradientmail.mailbox.s3_common import (
    CONFLICT_CODES,
    CREDENTIAL_CODES,
    REGION_CODES,
    TRANSIENT_CODES,
    error_fields,
)
from gradientmail.mailbox.s3_retry import root_cause

__all__ = [
    "BOTOCORE_DEFAULTS",
    "bucket_is_missing",
    "CONFLICT",
    "CREDENTIAL_ERRORS",
    "denied",
    "ensure_bucket",
    "EXISTS",
    "explain_failure",
    "FATAL",
    "make_client",
    "MISSING",
    "outcome",
    "ProcessClient",
    "REQUEST_ERRORS",
    "TRANSIENT",
    "TRANSPORT_ERRORS",
    "UNSUPPORTED",
]


BOTOCORE_DEFAULTS: dict[str, Any] = {
    "retries": {"mode": "standard", "total_max_attempts": 3},
    "connect_timeout": 10,
    "read_timeout": 60,
}
"""Client settings unless the caller's ``config`` (or, for retries, the environment) says otherwise."""

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

# One lock for lazy client creation in all mailboxes; replaced in a forked child, where a
# thread of the parent may have held it at the moment of the fork.
_CLIENT_LOCK = threading.Lock()

# Service models are loaded once per process and shared by every client: a fresh boto3
# session parses them again (~0.3 s per client instead of ~0.04 s).
_LOADER: Any = None


def _reset_client_lock() -> None:
    global _CLIENT_LOCK
    _CLIENT_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_client_lock)


class ProcessClient:
    """A boto3 S3 client made on first use in each process (again after a fork), never pickled.

    Args:
        factory: Makes the client instead of ``make_client`` (a fake in tests).
        settings: The keyword arguments of ``make_client``.
    """

    def __init__(self, factory: Callable[[], Any] | None = None, **settings: Any) -> None:
        self.factory = factory
        self.settings = settings
        self.client: Any = None
        self.pid = 0

    def get(self) -> Any:
        """This process's client."""
        client = self.client
        if client is not None and self.pid == os.getpid():
            return client
        with _CLIENT_LOCK:
            if self.client is None or self.pid != os.getpid():
                self.client = self.factory() if self.factory else make_client(**self.settings)
                self.pid = os.getpid()
            return self.client

    @property
    def endpoint_url(self) -> str | None:
        """The endpoint the client talks to, once it is made in this process."""
        made = self.client is not None and self.pid == os.getpid()
        return self.client.meta.endpoint_url if made else None

    def __getstate__(self) -> dict[str, Any]:
        return {"factory": self.factory, "settings": self.settings, "client": None, "pid": 0}  # no client


def make_client(
    *,
    endpoint_url: str | None,
    region_name: str | None,
    profile_name: str | None,
    client_kwargs: Mapping[str, Any],
    config: botocore.config.Config | Mapping[str, Any] | None,
) -> Any:
    """A new boto3 S3 client; credentials, profiles and ``AWS_*`` variables are read now.

    Raises:
        botocore.exceptions.NoCredentialsError: and the other ``CREDENTIAL_ERRORS``.
    """
    global _LOADER
    if _LOADER is None:
        _LOADER = botocore.loaders.create_loader(os.environ.get("AWS_DATA_PATH"))
    core = botocore.session.get_session()
    core.register_component("data_loader", _LOADER)
    session = boto3.session.Session(botocore_session=core, profile_name=profile_name, region_name=region_name)
    return session.client("s3", endpoint_url=endpoint_url, config=_client_config(core, config), **client_kwargs)


def _client_config(core: Any, config: botocore.config.Config | Mapping[str, Any] | None) -> botocore.config.Config:
    defaults = dict(BOTOCORE_DEFAULTS)
    # A retry setting in the environment or the profile wins over this module's default
    # (botocore lets any retry setting in a Config override both).
    profile = core.get_scoped_config()
    if any(os.environ.get(name) for name in ("AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS")) or any(
        name in profile for name in ("retry_mode", "max_attempts")
    ):
        del defaults["retries"]
    merged = botocore.config.Config(**defaults)
    if isinstance(config, botocore.config.Config):
        merged = merged.merge(config)
    elif config:
        merged = merged.merge(botocore.config.Config(**config))
    return merged


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


def bucket_is_missing(client: Any, bucket: str) -> bool:
    """One ``HeadBucket``: True only when the store says the bucket does not exist (404)."""
    try:
        client.head_bucket(Bucket=bucket)
    except botocore.exceptions.ClientError as exc:
        code, status, _ = error_fields(exc)
        return code in ("NoSuchBucket", "404", "NotFound") or status == 404
    except Exception:  # unreachable, or anything else: keep the first explanation
        return False
    return False


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


def ensure_bucket(client: Any, bucket: str) -> bool:
    """Create ``bucket`` unless it exists and is yours: True if created, False if it was there.

    Idempotent, so a recipe can run it on every machine: a second call (or a race with another
    machine) is not an error. Outside ``us-east-1`` the bucket is made in the client's region.

    Raises:
        botocore.exceptions.ClientError: the name is another account's (``BucketAlreadyExists``)
            or the credentials may not see or create it.
    """
    try:
        client.head_bucket(Bucket=bucket)
        return False
    except botocore.exceptions.ClientError as exc:
        code, status, _ = error_fields(exc)
        if not (code in ("NoSuchBucket", "404", "NotFound") or status == 404):
            raise
    region = client.meta.region_name
    options: dict[str, Any] = {}
    if region and region != "us-east-1":
        options["CreateBucketConfiguration"] = {"LocationConstraint": region}
    try:
        client.create_bucket(Bucket=bucket, **options)
    except botocore.exceptions.ClientError as exc:
        if error_fields(exc)[0] == "BucketAlreadyOwnedByYou":
            return False
        raise
    return True
