"""``S3Mailbox``: a prefix of an S3 bucket through boto3, with its client, credentials and retries.

Section ``s3_retry`` below: How long ``S3Mailbox`` keeps retrying, and reading a response body so that it can retry.

Transient faults are retried until ``retry_window`` has passed since the first failure, with
capped, fully jittered backoff (nodes neither give up early nor retry in lockstep); an endpoint
that never answered gets ``FIRST_CONTACT_ATTEMPTS`` rounds. See docs/mailboxes.md.

Section ``s3_client`` below: The boto3 side of ``S3Mailbox``: making a client, and classifying and explaining failures.

Kept apart from ``s3.py`` so that the backend reads as the five operations and their retries.

Section ``s3`` below: ``S3Mailbox``: a run prefix in an S3 (or S3-compatible) bucket, through boto3.

Atomicity: ``put_if_absent`` is one ``PutObject`` with ``If-None-Match: *`` and ``replace_if``
one with ``If-Match: <etag>``: the store itself refuses (412), so exactly one racer wins. A write
whose answer was lost is settled by a per-call token in the object's metadata
(``TOKEN_METADATA``), so a claim is never lost nor doubled. Transient faults are retried for
``retry_window`` (section ``s3_retry``). A bounded read (``max_bytes``) is one GET of the first
``max_bytes + 1`` bytes, whose answer names the object's size. Details: docs/mailboxes.md.
"""

from __future__ import annotations

import collections
import datetime
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import boto3
import botocore.config
import botocore.exceptions
import botocore.loaders
import botocore.session
import urllib3.exceptions

from gradientmail.errors import MailboxError, UnsafeStoreError, ValueTooLargeError
from gradientmail.mailbox.base import BaseVersionedMailbox
from gradientmail.mailbox.keys import validate_prefix
from gradientmail.mailbox.s3_common import (
    CONFLICT_CODES,
    CREDENTIAL_CODES,
    EMPTY_RANGE_CODE,
    REGION_CODES,
    TOKEN_METADATA,
    TRANSIENT_CODES,
    error_fields,
    first_bytes,
    list_keys,
    stored_size,
)

__all__ = [
    "BOTOCORE_DEFAULTS",
    "CONFLICT",
    "CONNECT_ERRORS",
    "CREDENTIAL_ERRORS",
    "DEFAULT_BACKOFF",
    "DEFAULT_MAX_ATTEMPTS",
    "DEFAULT_RETRY_WINDOW",
    "EXISTS",
    "FATAL",
    "FIRST_CONTACT_ATTEMPTS",
    "MAX_BACKOFF",
    "MISSING",
    "ProcessClient",
    "REQUEST_ERRORS",
    "RetryBudget",
    "S3Mailbox",
    "TRANSIENT",
    "TRANSPORT_ERRORS",
    "UNSUPPORTED",
    "bucket_is_missing",
    "check_retry_window",
    "denied",
    "ensure_bucket",
    "explain_failure",
    "log_recovery",
    "log_retry",
    "make_client",
    "outcome",
    "read_body",
    "root_cause",
]


# -- s3_retry ----------------------------------------------------------------------------------------

DEFAULT_RETRY_WINDOW = datetime.timedelta(minutes=2)
"""How long one operation retries transient faults: rides out a store restart or a short outage."""

FIRST_CONTACT_ATTEMPTS = 3
"""Rounds (each with botocore's own attempts) given to an endpoint that has never answered."""

MAX_BACKOFF = 5.0
"""Cap of one backoff sleep in seconds: retries keep probing at least this often."""

WARN_AFTER_FAILURES = 2
"""Failures of one operation from which its retries are a WARNING; a single retry is routine: DEBUG."""

WARN_EVERY_S = 30.0
"""While an outage lasts, one WARNING per operation at most this often."""

CONNECT_ERRORS = (
    botocore.exceptions.EndpointConnectionError,  # refused, no route, unknown host
    botocore.exceptions.ConnectTimeoutError,
    botocore.exceptions.ProxyConnectionError,
)
"""No connection could be made: the request never reached the store."""


def check_retry_window(window: Any) -> datetime.timedelta:
    """``window`` if it is a non-negative ``timedelta``.

    Raises:
        TypeError: ``window`` is not a ``timedelta``.
        ValueError: it is negative.

    Example:
        >>> check_retry_window(datetime.timedelta(minutes=2))
        datetime.timedelta(seconds=120)
    """
    if not isinstance(window, datetime.timedelta):
        raise TypeError(
            f"retry_window must be a datetime.timedelta (e.g. timedelta(minutes=2)), "
            f"not {type(window).__name__} {window!r}"
        )
    if window < datetime.timedelta(0):
        raise ValueError(f"retry_window must not be negative, not {window}")
    return window


class RetryBudget:
    """The retries left to one operation; ``spend()`` after each transient failure.

    Args:
        window: seconds after the first failure during which failures are retried.
        backoff: the first backoff bound in seconds, doubled per failure up to ``MAX_BACKOFF``.
        max_rounds: if set, retrying also stops after this many failures (and after
            ``FIRST_CONTACT_ATTEMPTS`` for an endpoint that never answered).
    """

    def __init__(self, window: float, backoff: float, max_rounds: int | None = None) -> None:
        self.window = window
        self.backoff = backoff
        self.max_rounds = max_rounds
        self.failures = 0
        self._started = time.monotonic()
        self._first_failure: float | None = None
        self.warned_at: float | None = None
        """When a retry of this operation was last logged as a WARNING (``log_retry``)."""

    @property
    def elapsed(self) -> float:
        """Seconds since the operation started."""
        return time.monotonic() - self._started

    def spend(self, *, first_contact: bool = False) -> bool:
        """Count a failure; sleep and return True when another attempt is due, else False."""
        now = time.monotonic()
        if self._first_failure is None:
            self._first_failure = now
        self.failures += 1
        limit = self.max_rounds
        if first_contact:
            limit = min(limit or FIRST_CONTACT_ATTEMPTS, FIRST_CONTACT_ATTEMPTS)
        if limit is not None and self.failures >= limit:
            return False
        remaining = self._first_failure + self.window - now
        if remaining <= 0:
            return False
        delay = random.uniform(0, min(MAX_BACKOFF, self.backoff * 2 ** (self.failures - 1)))
        time.sleep(min(delay, remaining))
        return True


def log_retry(log: logging.Logger, store: str, exc: BaseException, budget: RetryBudget, limits: str) -> None:
    """Log a retry about to be made: DEBUG at first, then a WARNING at most every ``WARN_EVERY_S``.

    Args:
        log: the logger.
        store: the store's description.
        exc: the failure being retried.
        budget: the operation's ``RetryBudget`` (its failures and when it last warned).
        limits: how long retrying may go on, for the message.
    """
    reason = root_cause(exc) or f"{type(exc).__name__}: {exc}"[:200]
    now = time.monotonic()
    loud = budget.failures >= WARN_AFTER_FAILURES and (
        budget.warned_at is None or now - budget.warned_at >= WARN_EVERY_S
    )
    if loud:
        budget.warned_at = now
    log.log(
        logging.WARNING if loud else logging.DEBUG,
        "%s: store failing (%s), %d failed attempts over %.1fs; retrying (%s)",
        store,
        reason,
        budget.failures,
        budget.elapsed,
        limits,
    )


def log_recovery(log: logging.Logger, store: str, operation: str, budget: RetryBudget) -> None:
    """After a success: say so at INFO when this operation's retries were logged as a WARNING."""
    if budget.warned_at is not None:
        log.info(
            "%s: %s succeeded after %d failed attempts over %.1fs; the store is back",
            store,
            operation,
            budget.failures,
            budget.elapsed,
        )


_READ_BLOCK = 2**20


def read_body(response: dict[str, Any], limit: int | None = None) -> bytes:
    """The body of a ``GetObject`` answer, whole or its first ``limit`` bytes; a broken body
    raises a botocore error (retried). The body is closed after: the rest is never downloaded.

    Raises:
        botocore.exceptions.BotoCoreError: the body was cut off, stalled or short.
    """
    # StreamingBody.read turns a dropped, stalled or short body into botocore's
    # ResponseStreamingError, ReadTimeoutError or IncompleteReadError; `with body as stream`
    # would yield the raw urllib3 stream, whose errors are not botocore's.
    body = response["Body"]
    try:
        if limit is None:
            return body.read()
        chunks = []
        while limit > 0:
            # A block at a time (a read of n bytes may allocate n first); at the end b"", and
            # StreamingBody then checks the length.
            chunk = body.read(min(limit, _READ_BLOCK))
            if not chunk:
                break
            chunks.append(chunk)
            limit -= len(chunk)
        return b"".join(chunks)
    except urllib3.exceptions.HTTPError as exc:  # in case a urllib3 error slips through
        raise botocore.exceptions.ResponseStreamingError(error=exc) from exc
    finally:
        body.close()


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


# -- s3_client ---------------------------------------------------------------------------------------

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


# -- s3 ----------------------------------------------------------------------------------------------

_log = logging.getLogger("gradientmail.mailbox")

DEFAULT_MAX_ATTEMPTS = 6
"""The former default of ``max_attempts``; the default is now None: retry for ``retry_window``."""

DEFAULT_BACKOFF = 0.1
"""Base of the loop's exponential backoff in seconds (full jitter, capped at ``MAX_BACKOFF``)."""

T = TypeVar("T")


class S3Mailbox(BaseVersionedMailbox):
    """A mailbox under ``prefix`` in the S3 bucket ``bucket``; the client is made per process.

    Args:
        bucket: Bucket name; it must exist.
        prefix: Run prefix inside the bucket (``runs/exp-7``); normalised to end with ``/``.
        endpoint_url: An S3-compatible endpoint (MinIO, R2, moto); None: boto3's chain
            (``AWS_ENDPOINT_URL``...), else AWS.
        region_name: Region; None: boto3's chain (``AWS_REGION``, profile).
        profile_name: A profile in ``~/.aws/config``; None: boto3's credential chain.
        retry_window: How long one operation retries transient faults, from its first failure;
            an endpoint that has never answered fails after a few seconds instead.
        max_attempts: Also stop after this many rounds of the retry loop; None: the window only.
        backoff: Base of the loop's jittered exponential backoff, in seconds (capped at 5 s).
        client_kwargs: More keyword arguments for ``boto3.Session.client``.
        config: A ``botocore.config.Config`` (or its arguments) merged over ``BOTOCORE_DEFAULTS``.
        client_factory: Makes the S3 client instead of boto3 (a fake in tests); called once per process.

    The client is dropped when the mailbox is pickled, so it can go to DataLoader workers.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region_name: str | None = None,
        profile_name: str | None = None,
        retry_window: datetime.timedelta = DEFAULT_RETRY_WINDOW,
        max_attempts: int | None = None,
        backoff: float = DEFAULT_BACKOFF,
        client_kwargs: Mapping[str, Any] | None = None,
        config: botocore.config.Config | Mapping[str, Any] | None = None,
        client_factory: Callable[[], Any] | None = None,
    ) -> None:
        if not isinstance(bucket, str) or not bucket or "/" in bucket:
            raise ValueError(f"S3 bucket must be a non-empty name without '/', not {bucket!r}")
        if prefix is None:
            prefix = ""
        validate_prefix(prefix)  # a run prefix follows the rules of a list prefix
        self.retry_window = check_retry_window(retry_window)
        if max_attempts is not None and max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1 or None, not {max_attempts}")
        if backoff < 0:
            raise ValueError(f"backoff must be >= 0, not {backoff}")
        self.bucket = bucket
        self.prefix = prefix if not prefix or prefix.endswith("/") else prefix + "/"
        self._bare_if_match = False  # set once the store refused a quoted If-Match and took a bare one
        self.endpoint_url = endpoint_url
        self.region_name = region_name
        self.profile_name = profile_name
        self.max_attempts = max_attempts
        self.backoff = backoff
        self.client_kwargs = dict(client_kwargs or {})
        self.config = config
        self._clients = ProcessClient(
            client_factory,
            endpoint_url=endpoint_url,
            region_name=region_name,
            profile_name=profile_name,
            client_kwargs=self.client_kwargs,
            config=config,
        )
        # Whether the endpoint ever answered this mailbox (kept when pickled to workers): an
        # endpoint that never did is misconfigured, one that did and stopped is an outage.
        self._answered = False

    @property
    def answered(self) -> bool:
        """Whether the endpoint ever answered this mailbox (or the one it was pickled from)."""
        return self._answered

    # -- identity, pickling ------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    def __repr__(self) -> str:
        extra = f", endpoint_url={self.endpoint_url!r}" if self.endpoint_url else ""
        return f"S3Mailbox({self.bucket!r}, {self.prefix!r}{extra})"

    @property
    def client(self) -> Any:
        """This process's boto3 S3 client, created on first use (and again after a fork).

        Exposed so that callers can register botocore event hooks (metrics, fault injection).
        """
        try:
            return self._clients.get()
        except CREDENTIAL_ERRORS as exc:
            raise self._error("connect", "", exc) from exc

    @property
    def _endpoint(self) -> str | None:
        return self.endpoint_url or self._clients.endpoint_url

    @property
    def _store(self) -> str:
        endpoint = self._endpoint
        return f"{self.url} (endpoint {endpoint})" if endpoint else self.url

    # -- errors and retries ------------------------------------------------------------------
    def _budget(self, max_rounds: int | None = None) -> RetryBudget:
        """A fresh budget for one operation: ``retry_window``, at most ``max_attempts`` rounds
        (and ``max_rounds`` when given)."""
        limits = [n for n in (self.max_attempts, max_rounds) if n is not None]
        return RetryBudget(self.retry_window.total_seconds(), self.backoff, min(limits) if limits else None)

    def _heard_from(self, exc: BaseException | None = None) -> None:
        """Record that the endpoint answered (a result, or an error the store itself sent)."""
        if exc is None or isinstance(exc, botocore.exceptions.ClientError):
            self._answered = True

    def _first_contact(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a failure to connect to an endpoint that has never answered."""
        return not self._answered and isinstance(exc, CONNECT_ERRORS)

    def _retry(self, exc: BaseException, budget: RetryBudget) -> bool:
        """After ``exc``: True (having slept) when the operation should try again."""
        if outcome(exc) not in (TRANSIENT, CONFLICT):
            budget.failures += 1
            return False
        again = budget.spend(first_contact=self._first_contact(exc))
        if again:
            log_retry(_log, self._store, exc, budget, self._limits())
        return again

    def _limits(self) -> str:
        limits = f"retry_window={self.retry_window}"
        return limits + (f", max_attempts={self.max_attempts}" if self.max_attempts else "")

    def _error(
        self,
        operation: str,
        key: str,
        exc: BaseException,
        budget: RetryBudget | None = None,
        note: str = "",
    ) -> MailboxError:
        what = f"{self._store}: {operation}({key!r})" if key else f"{self._store}: {operation}"
        explanation = explain_failure(
            exc,
            bucket=self.bucket,
            endpoint=self._endpoint or "(boto3's default)",
            limits=self._limits(),
            first_contact=self._first_contact(exc),
            bucket_missing=denied(exc) and bucket_is_missing(self.client, self.bucket),
        )
        attempts = budget.failures if budget is not None else 1
        tries = ""
        if budget is not None and attempts > 1:
            tries = f" after {attempts} attempts over {budget.elapsed:.1f}s"
        return MailboxError(
            f"{what} failed{tries}: {explanation}{note}",
            operation=operation,
            key=key,
            store=self._store,
        )

    def _retrying(
        self,
        operation: str,
        key: str,
        request: Callable[[Any], T],
        budget: RetryBudget | None = None,
    ) -> T:
        """``request(client)`` with retries of transient errors; other errors → MailboxError."""
        budget = budget or self._budget()
        while True:
            try:
                result = request(self.client)
            except REQUEST_ERRORS as exc:
                self._heard_from(exc)
                if self._retry(exc, budget):
                    continue
                raise self._error(operation, key, exc, budget) from exc
            self._heard_from()
            log_recovery(_log, self._store, operation, budget)
            return result

    # -- the raw operations (BaseMailbox validated the arguments) -----------------------------
    def _put_if_absent(self, key: str, data: bytes) -> bool:
        return self._conditional_put(
            "put_if_absent",
            key,
            data,
            {"IfNoneMatch": "*"},
            lost=(EXISTS,),
            unsupported=(
                "the store does not support conditional writes (If-None-Match: *). Without them "
                "two nodes could claim the same unit (Backblaze B2 answers this way); use AWS S3, "
                "MinIO, Cloudflare R2 or a shared directory"
            ),
        )

    def _conditional_put(
        self,
        operation: str,
        key: str,
        data: bytes,
        condition: dict[str, str],
        *,
        lost: tuple[str, ...],
        unsupported: str,
    ) -> bool:
        """One conditional ``PutObject`` with retries; True if this call's write took effect.

        Each call sends a fresh token as metadata: when an answer in ``lost`` (the condition
        failed) or a final error follows an attempt that may have landed (botocore retried, a
        5xx, a timeout), a ``HeadObject`` compares the token instead of guessing.
        """
        name, body = self.prefix + key, data
        token = uuid.uuid4().hex
        ambiguous = False  # could an earlier attempt of this call have written the object?
        budget = self._budget()
        while True:
            try:
                self.client.put_object(
                    Bucket=self.bucket,
                    Key=name,
                    Body=body,
                    Metadata={TOKEN_METADATA: token},
                    **condition,
                )
                self._heard_from()
                log_recovery(_log, self._store, operation, budget)
                return True
            except REQUEST_ERRORS as exc:
                self._heard_from(exc)
                answer = outcome(exc)
                ambiguous = ambiguous or error_fields(exc)[2] > 0 or answer == TRANSIENT
                if answer in lost:
                    return self._created_by(name, key, token) if ambiguous else False
                if answer == UNSUPPORTED:
                    code, status, _ = error_fields(exc)
                    raise UnsafeStoreError(
                        f"{self._store}: {operation}({key!r}): {unsupported} (the store answered {code or status})",
                        operation=operation,
                        key=key,
                        store=self._store,
                    ) from exc
                if self._retry(exc, budget):
                    continue
                retryable = answer in (TRANSIENT, CONFLICT)
                if not (ambiguous and retryable) or self._first_contact(exc):
                    # An endpoint that never answered cannot have taken the write either.
                    raise self._error(operation, key, exc, budget) from exc
                # Every answer was an error, yet one of the writes may have landed: a short
                # read-back (the window is spent) decides; if it fails too, say so.
                try:
                    if self._created_by(name, key, token, self._budget(max_rounds=2)):
                        return True
                except MailboxError:
                    note = "; whether the write landed is unknown: reading it back failed too"
                    raise self._error(operation, key, exc, budget, note) from exc
                raise self._error(operation, key, exc, budget) from exc

    def _head(self, name: str, key: str, operation: str, budget: RetryBudget | None = None) -> dict[str, Any] | None:
        """``HeadObject`` of ``name`` with retries, or None when it does not exist."""

        def head(client: Any) -> dict[str, Any] | None:
            try:
                return client.head_object(Bucket=self.bucket, Key=name)
            except botocore.exceptions.ClientError as exc:
                if error_fields(exc)[1] == 404:
                    return None
                raise

        return self._retrying(operation, key, head, budget)

    def _created_by(self, name: str, key: str, token: str, budget: RetryBudget | None = None) -> bool:
        """Whether the object ``name`` exists and carries this call's ``token``."""
        response = self._head(name, key, "put_if_absent (reading back an ambiguous write)", budget)
        return response is not None and (response.get("Metadata") or {}).get(TOKEN_METADATA) == token

    # -- compare-and-swap (see VersionedMailbox) -----------------------------------------------
    def _get_versioned(self, key: str, max_bytes: int | None) -> tuple[bytes, str] | None:
        return self._get_object("get_versioned", key, max_bytes)

    def _get_object(self, operation: str, key: str, max_bytes: int | None) -> tuple[bytes, str] | None:
        """(body, ETag) of ``key`` with retries, or None when it does not exist.

        With ``max_bytes``, one GET of the first ``max_bytes + 1`` bytes (``Range``; no HEAD):
        the answer names the object's size, so a longer one is refused with its body unread, and
        a store that ignores ``Range`` (sending the whole object) is read no further either.
        """
        name = self.prefix + key

        def request(client: Any) -> tuple[bytes, str] | None:
            ranged = {} if max_bytes is None else {"Range": first_bytes(max_bytes + 1)}
            try:
                try:
                    response = client.get_object(Bucket=self.bucket, Key=name, **ranged)
                except botocore.exceptions.ClientError as exc:
                    if not (ranged and error_fields(exc)[0] == EMPTY_RANGE_CODE):
                        raise
                    # An empty object has no byte 0 to range over: read it plainly (still bounded).
                    response = client.get_object(Bucket=self.bucket, Key=name)
            except botocore.exceptions.ClientError as exc:
                if outcome(exc) == MISSING:
                    return None
                raise
            if max_bytes is None:
                return read_body(response), str(response["ETag"])
            size = stored_size(response)
            if size is not None and size > max_bytes:
                response["Body"].close()
                raise ValueTooLargeError(key, max_bytes, size, store=self._store)
            return read_body(response, max_bytes + 1), str(response["ETag"])

        return self._retrying(operation, key, request)

    def _replace_if(self, key: str, data: bytes, version: str) -> bool:
        if not version:
            raise TypeError(f"version must be an ETag from get_versioned, not {version!r}")
        bare = version.strip('"')
        if self._bare_if_match:
            return self._if_match(key, data, bare)
        if self._if_match(key, data, version):
            return True
        # GetObject returns the ETag quoted, and some stores (Ceph's radosgw) refuse that form in
        # If-Match (412) while accepting it bare. If the object still has this ETag, the
        # condition held: try the bare form once, and keep using it if the store takes it.
        if bare == version:
            return False
        current = self._head(self.prefix + key, key, "replace_if (reading the ETag back)")
        if current is None or str(current.get("ETag", "")).strip('"') != bare:
            return False  # really changed (or gone): lost
        if self._if_match(key, data, bare):
            self._bare_if_match = True
            _log.info("%s: the store takes If-Match ETags only unquoted; sending them so", self._store)
            return True
        return False

    def _if_match(self, key: str, data: bytes, etag: str) -> bool:
        # 412: the ETag no longer matches (perhaps because our own earlier attempt landed);
        # 404: the object is gone.
        return self._conditional_put(
            "replace_if",
            key,
            data,
            {"IfMatch": etag},
            lost=(EXISTS, MISSING),
            unsupported=(
                "the store does not support conditional overwrites (If-Match); leases and "
                "resume need them (AWS S3, MinIO and Cloudflare R2 support them)"
            ),
        )

    def _get(self, key: str, max_bytes: int | None) -> bytes | None:
        found = self._get_object("get", key, max_bytes)
        return None if found is None else found[0]

    def _put(self, key: str, data: bytes) -> None:
        name = self.prefix + key
        self._retrying("put", key, lambda client: client.put_object(Bucket=self.bucket, Key=name, Body=data))

    def _delete(self, key: str) -> None:
        name = self.prefix + key
        self._retrying("delete", key, lambda client: client.delete_object(Bucket=self.bucket, Key=name))

    def _list(self, prefix: str, start_after: str | None) -> Iterator[str]:
        def fetch(request: dict[str, Any]) -> Any:
            return self._retrying("list", prefix, lambda client: client.list_objects_v2(**request))

        return list_keys(fetch, self.bucket, self.prefix, prefix, start_after)
