"""``S3Mailbox``: a run prefix in an S3 (or S3-compatible) bucket, through boto3.

Atomicity: ``put_if_absent`` is one ``PutObject`` with ``If-None-Match: *``; the store itself
refuses to create a key that exists (412 PreconditionFailed), so exactly one of several racing
creators wins. AWS S3, MinIO and Cloudflare R2 enforce the header. A store that silently ignores
it would let every node win every claim: ``verify()`` (``verify_mailbox``) detects that, and a
store that answers 501 NotImplemented (Backblaze B2) is refused with ``UnsafeStoreError``.

Ambiguous outcomes: when a write lands but its answer is lost (a 5xx, a timeout, a reset
connection), the retry finds the key already there and gets a 412 against its *own* object.
Each ``put_if_absent`` therefore sends a fresh random token as object metadata
(``x-amz-meta-gm-token``; the body stays exactly the caller's bytes), and whenever a 412 (or a
final failure) follows a retry, botocore's or ours, a ``HeadObject`` compares the token to decide.
A claim is thus never lost and never doubled.

Compare-and-swap (``replace_if``, for leases and resume): the version is the object's ETag, and
``replace_if`` is one ``PutObject`` with ``If-Match: <etag>``; the store refuses it (412) when
the object changed, and answers 404 when it is gone. Ambiguous retries are settled with the
same metadata token, and 409 ConditionalRequestConflict is retried. AWS S3 enforces
``If-Match`` on writes since 2024-11; MinIO and R2 do too.

Retries: botocore's ``standard`` retry mode handles throttling, 5xx and connection errors first;
a loop here retries on top until ``retry_window`` (2 minutes by default) has passed since the
operation's first failure, with capped, jittered exponential backoff (``s3_retry``), so a run
rides out a short outage of its store. It also retries 409 ConditionalRequestConflict, which
botocore never retries, and response bodies cut off mid-way. An endpoint that has never
answered (connection refused, unknown host) fails within a few seconds instead: that is a wrong
address, not an outage.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import boto3
import botocore.config
import botocore.exceptions
import botocore.loaders
import botocore.session

from gradientmail.errors import MailboxError, UnsafeStoreError
from gradientmail.mailbox.base import verify_mailbox
from gradientmail.mailbox.keys import validate_key, validate_prefix, validate_value
from gradientmail.mailbox.s3_listing import list_keys
from gradientmail.mailbox.s3_retry import (
    CONNECT_ERRORS,
    DEFAULT_RETRY_WINDOW,
    MAX_BACKOFF,  # noqa: F401  (importable from here, as before)
    RetryBudget,
    check_retry_window,
    log_recovery,
    log_retry,
    read_body,
    root_cause,
)

_log = logging.getLogger("gradientmail.mailbox")

TOKEN_METADATA = "gm-token"
"""User-metadata name of the per-call creation token (sent as ``x-amz-meta-gm-token``)."""

DEFAULT_MAX_ATTEMPTS = 6
"""The former default of ``max_attempts``; the default is now None: retry for ``retry_window``."""

DEFAULT_BACKOFF = 0.1
"""Base of the loop's exponential backoff in seconds (full jitter, capped at ``MAX_BACKOFF``)."""

LIST_PAGE = 1000
"""Keys per ``ListObjectsV2`` page (S3's maximum)."""

_BOTOCORE_DEFAULTS: dict[str, Any] = {
    "retries": {"mode": "standard", "total_max_attempts": 3},
    "connect_timeout": 10,
    "read_timeout": 60,
}

# Outcomes of a failed request, as this module acts on them.
_EXISTS, _MISSING, _CONFLICT, _TRANSIENT, _UNSUPPORTED, _FATAL = (
    "exists",
    "missing",
    "conflict",
    "transient",
    "unsupported",
    "fatal",
)
_TRANSIENT_CODES = frozenset(
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
_CONFLICT_CODES = frozenset({"ConditionalRequestConflict", "OperationAborted"})
_CREDENTIAL_CODES = frozenset(
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
_REGION_CODES = frozenset(
    {
        "PermanentRedirect",
        "AuthorizationHeaderMalformed",
        "IllegalLocationConstraintException",
    }
)
_TRANSPORT_ERRORS = (
    botocore.exceptions.ConnectionError,  # includes connect timeouts and unreachable endpoints
    botocore.exceptions.HTTPClientError,  # read timeouts, closed connections, broken streams
    botocore.exceptions.IncompleteReadError,
)
_CREDENTIAL_ERRORS = (
    botocore.exceptions.NoCredentialsError,
    botocore.exceptions.PartialCredentialsError,
    botocore.exceptions.CredentialRetrievalError,
    botocore.exceptions.ProfileNotFound,
)
_REQUEST_ERRORS = (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError)

T = TypeVar("T")

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


def _error_fields(exc: BaseException) -> tuple[str, int, int]:
    """(error code, HTTP status, retries botocore already made) of a botocore error."""
    response = getattr(exc, "response", None) or {}
    metadata = response.get("ResponseMetadata") or {}
    code = str((response.get("Error") or {}).get("Code") or "")
    return code, int(metadata.get("HTTPStatusCode") or 0), int(metadata.get("RetryAttempts") or 0)


def _outcome(exc: BaseException) -> str:
    if isinstance(exc, _TRANSPORT_ERRORS):
        return _TRANSIENT
    if not isinstance(exc, botocore.exceptions.ClientError):
        return _FATAL
    code, status, _ = _error_fields(exc)
    message = str((exc.response.get("Error") or {}).get("Message") or "")
    if code == "PreconditionFailed" or status == 412:
        return _EXISTS
    if code in ("NoSuchKey", "NotFound", "404") and status == 404:
        return _MISSING
    if code in _CONFLICT_CODES:
        return _CONFLICT
    if code == "NotImplemented" or status == 501 or (status == 400 and "if-none-match" in message.lower()):
        return _UNSUPPORTED
    if code in _TRANSIENT_CODES or status == 429 or status >= 500:
        return _TRANSIENT
    return _FATAL


class S3Mailbox:
    """A mailbox under ``prefix`` in the S3 bucket ``bucket``.

    Args:
        bucket: Bucket name; it must exist.
        prefix: Run prefix inside the bucket (``runs/exp-7``); normalised to end with ``/``.
            Two mailboxes with different prefixes in one bucket never see each other's keys.
        endpoint_url: An S3-compatible endpoint (MinIO, R2, moto). When None, boto3 honours
            ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` and otherwise talks to AWS.
        region_name: Region; when None, boto3's chain decides (``AWS_REGION``, profile).
        profile_name: A profile in ``~/.aws/config``; when None, boto3's chain decides
            (``AWS_PROFILE``, environment credentials, instance and container roles, ...).
        retry_window: How long one operation retries transient faults (throttling, 5xx,
            timeouts, dropped connections, an unreachable store), counted from its first
            failure: a run rides out an outage shorter than this. An endpoint that has never
            answered fails after a few seconds instead.
        max_attempts: When set, also stop after this many rounds of the retry loop (each
            holding botocore's own attempts); None retries for ``retry_window``.
        backoff: Base of the loop's jittered exponential backoff, in seconds (capped at 5 s).
        client_kwargs: More keyword arguments for ``boto3.Session.client`` (``verify``,
            ``aws_access_key_id``, ...).
        config: A ``botocore.config.Config`` or a mapping of its arguments, merged over the
            defaults: standard retry mode with 3 attempts in all (unless ``AWS_RETRY_MODE``,
            ``AWS_MAX_ATTEMPTS`` or the profile set retries), 10 s connect and 60 s read timeouts.

    The boto3 client is created lazily in each process (see ``client``) and dropped when the
    mailbox is pickled, so a mailbox can be handed to DataLoader workers or spawned processes.
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
    ) -> None:
        if not isinstance(bucket, str) or not bucket or "/" in bucket:
            raise ValueError(f"S3 bucket must be a non-empty name without '/', not {bucket!r}")
        if prefix is None:
            prefix = ""
        validate_prefix(prefix)
        self.retry_window = check_retry_window(retry_window)
        if max_attempts is not None and max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1 or None, not {max_attempts}")
        if backoff < 0:
            raise ValueError(f"backoff must be >= 0, not {backoff}")
        self.bucket = bucket
        self.prefix = prefix if not prefix or prefix.endswith("/") else prefix + "/"
        self.endpoint_url = endpoint_url
        self.region_name = region_name
        self.profile_name = profile_name
        self.max_attempts = max_attempts
        self.backoff = backoff
        self.client_kwargs = dict(client_kwargs or {})
        self.config = config
        self._client: Any = None
        self._client_pid = 0
        # Whether the endpoint ever answered this mailbox (kept when pickled to workers): an
        # endpoint that never did is misconfigured, one that did and stopped is an outage.
        self._answered = False

    # -- identity, pickling ------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    def __repr__(self) -> str:
        extra = f", endpoint_url={self.endpoint_url!r}" if self.endpoint_url else ""
        return f"S3Mailbox({self.bucket!r}, {self.prefix!r}{extra})"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = None  # a boto3 client does not pickle; each process makes its own
        state["_client_pid"] = 0
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_answered", False)
        self.__dict__.setdefault("retry_window", DEFAULT_RETRY_WINDOW)

    @property
    def client(self) -> Any:
        """This process's boto3 S3 client, created on first use (and again after a fork).

        Exposed so that callers can register botocore event hooks (metrics, fault injection).
        """
        client = self._client
        if client is not None and self._client_pid == os.getpid():
            return client
        with _CLIENT_LOCK:
            if self._client is None or self._client_pid != os.getpid():
                self._client = self._make_client()
                self._client_pid = os.getpid()
            return self._client

    def _make_client(self) -> Any:
        global _LOADER
        if _LOADER is None:
            _LOADER = botocore.loaders.create_loader(os.environ.get("AWS_DATA_PATH"))
        core = botocore.session.get_session()
        core.register_component("data_loader", _LOADER)
        try:
            # A new session per client: credentials, profiles and AWS_* variables are read now.
            session = boto3.session.Session(
                botocore_session=core, profile_name=self.profile_name, region_name=self.region_name
            )
            return session.client(
                "s3",
                endpoint_url=self.endpoint_url,
                config=self._client_config(core),
                **self.client_kwargs,
            )
        except _CREDENTIAL_ERRORS as exc:
            raise self._error("connect", "", exc) from exc

    def _client_config(self, core: Any) -> botocore.config.Config:
        defaults = dict(_BOTOCORE_DEFAULTS)
        # A retry setting in the environment or the profile wins over this module's default
        # (botocore lets any retry setting in a Config override both).
        profile = core.get_scoped_config()
        if any(os.environ.get(name) for name in ("AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS")) or any(
            name in profile for name in ("retry_mode", "max_attempts")
        ):
            del defaults["retries"]
        config = botocore.config.Config(**defaults)
        if isinstance(self.config, botocore.config.Config):
            config = config.merge(self.config)
        elif self.config:
            config = config.merge(botocore.config.Config(**self.config))
        return config

    @property
    def _endpoint(self) -> str | None:
        endpoint = self.endpoint_url
        if endpoint is None and self._client is not None:
            endpoint = self._client.meta.endpoint_url
        return endpoint

    @property
    def _store(self) -> str:
        endpoint = self._endpoint
        return f"{self.url} (endpoint {endpoint})" if endpoint else self.url

    def _object_key(self, key: str) -> str:
        return self.prefix + validate_key(key)

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
        if _outcome(exc) not in (_TRANSIENT, _CONFLICT):
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
        code, status, _ = _error_fields(exc)
        what = f"{self._store}: {operation}({key!r})" if key else f"{self._store}: {operation}"
        if isinstance(exc, botocore.exceptions.ClientError):
            detail = f"{code or status}: {(exc.response.get('Error') or {}).get('Message', '')}"
        else:
            detail = f"{type(exc).__name__}: {exc}"
        endpoint = self._endpoint or "(boto3's default)"
        if isinstance(exc, _CREDENTIAL_ERRORS):
            cause = (
                "no usable AWS credentials: boto3 looks at AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or profile_name, ~/.aws/credentials and "
                "instance or container roles"
            )
        elif code == "NoSuchBucket":
            cause = (
                f"bucket {self.bucket!r} does not exist at this endpoint: create it, or check "
                "the name, endpoint_url / AWS_ENDPOINT_URL and region"
            )
        elif code in _CREDENTIAL_CODES or status == 403:
            cause = (
                "the credentials were rejected or lack permission (s3:GetObject, s3:PutObject, "
                "s3:DeleteObject and s3:ListBucket on this bucket and prefix are needed)"
            )
        elif code in _REGION_CODES:
            cause = "the bucket lives in another region: pass region_name or set AWS_REGION"
        elif self._first_contact(exc):
            reason = root_cause(exc) or type(exc).__name__
            cause = (
                f"endpoint {endpoint} is unreachable ({reason}) and has never answered: check "
                "endpoint_url / AWS_ENDPOINT_URL, that the store is running, and the network"
            )
        elif isinstance(exc, _TRANSPORT_ERRORS):
            reason = root_cause(exc) or type(exc).__name__
            cause = (
                f"endpoint {endpoint} is unreachable or breaking connections ({reason}), for "
                f"longer than the retries allow ({self._limits()}): the store or the network "
                "is down; a longer retry_window rides out longer outages"
            )
        elif _outcome(exc) in (_TRANSIENT, _CONFLICT):
            cause = (
                "the store kept failing (throttling, server errors or timeouts) for longer "
                f"than the retries allow ({self._limits()}); retry later or raise retry_window"
            )
        else:
            cause = "unexpected answer from the store"
        attempts = budget.failures if budget is not None else 1
        tries = ""
        if budget is not None and attempts > 1:
            tries = f" after {attempts} attempts over {budget.elapsed:.1f}s"
        return MailboxError(
            f"{what} failed{tries}: {detail} ({cause}){note}",
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
            except _REQUEST_ERRORS as exc:
                self._heard_from(exc)
                if self._retry(exc, budget):
                    continue
                raise self._error(operation, key, exc, budget) from exc
            self._heard_from()
            log_recovery(_log, self._store, operation, budget)
            return result

    # -- the five primitives ---------------------------------------------------------------
    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self._conditional_put(
            "put_if_absent",
            key,
            data,
            {"IfNoneMatch": "*"},
            lost=(_EXISTS,),
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
        name = self._object_key(key)
        body = validate_value(data, key)
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
            except _REQUEST_ERRORS as exc:
                self._heard_from(exc)
                outcome = _outcome(exc)
                ambiguous = ambiguous or _error_fields(exc)[2] > 0 or outcome == _TRANSIENT
                if outcome in lost:
                    return self._created_by(name, key, token) if ambiguous else False
                if outcome == _UNSUPPORTED:
                    code, status, _ = _error_fields(exc)
                    raise UnsafeStoreError(
                        f"{self._store}: {operation}({key!r}): {unsupported} (the store answered {code or status})",
                        operation=operation,
                        key=key,
                        store=self._store,
                    ) from exc
                if self._retry(exc, budget):
                    continue
                retryable = outcome in (_TRANSIENT, _CONFLICT)
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

    def _created_by(self, name: str, key: str, token: str, budget: RetryBudget | None = None) -> bool:
        """Whether the object ``name`` exists and carries this call's ``token``."""

        def head(client: Any) -> str | None:
            try:
                response = client.head_object(Bucket=self.bucket, Key=name)
            except botocore.exceptions.ClientError as exc:
                if _error_fields(exc)[1] == 404:
                    return None
                raise
            return (response.get("Metadata") or {}).get(TOKEN_METADATA)

        operation = "put_if_absent (reading back an ambiguous write)"
        return self._retrying(operation, key, head, budget) == token

    # -- compare-and-swap (optional capability, see VersionedMailbox) ------------------------
    supports_replace_if = True

    def get_versioned(self, key: str) -> tuple[bytes, str] | None:
        return self._get_object("get_versioned", key)

    def _get_object(self, operation: str, key: str) -> tuple[bytes, str] | None:
        """(body, ETag) of ``key`` with retries, or None when it does not exist."""
        name = self._object_key(key)

        def request(client: Any) -> tuple[bytes, str] | None:
            try:
                response = client.get_object(Bucket=self.bucket, Key=name)
            except botocore.exceptions.ClientError as exc:
                if _outcome(exc) == _MISSING:
                    return None
                raise
            return read_body(response), str(response["ETag"])

        return self._retrying(operation, key, request)

    def replace_if(self, key: str, data: bytes, version: str) -> bool:
        if not isinstance(version, str) or not version:
            raise TypeError(f"version must be an ETag from get_versioned, not {version!r}")
        # 412: the ETag no longer matches (perhaps because our own earlier attempt landed);
        # 404: the object is gone.
        return self._conditional_put(
            "replace_if",
            key,
            data,
            {"IfMatch": version},
            lost=(_EXISTS, _MISSING),
            unsupported=(
                "the store does not support conditional overwrites (If-Match); leases and "
                "resume need them (AWS S3, MinIO and Cloudflare R2 support them)"
            ),
        )

    def get(self, key: str) -> bytes | None:
        found = self._get_object("get", key)
        return None if found is None else found[0]

    def put(self, key: str, data: bytes) -> None:
        name = self._object_key(key)
        body = validate_value(data, key)
        self._retrying("put", key, lambda client: client.put_object(Bucket=self.bucket, Key=name, Body=body))

    def delete(self, key: str) -> None:
        name = self._object_key(key)
        self._retrying("delete", key, lambda client: client.delete_object(Bucket=self.bucket, Key=name))

    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        def fetch(request: dict[str, Any]) -> Any:
            return self._retrying("list", prefix, lambda client: client.list_objects_v2(**request))

        return list_keys(fetch, self.bucket, self.prefix, prefix, start_after)

    def verify(self) -> None:
        """Check that conditional creation works here (see ``verify_mailbox``)."""
        verify_mailbox(self)
