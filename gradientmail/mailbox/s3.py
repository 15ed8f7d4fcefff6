"""``S3Mailbox``: a run prefix in an S3 (or S3-compatible) bucket, through boto3.

Atomicity: ``put_if_absent`` is one ``PutObject`` with ``If-None-Match: *`` and ``replace_if``
one with ``If-Match: <etag>``: the store itself refuses (412), so exactly one racer wins. A write
whose answer was lost is settled by a per-call token in the object's metadata
(``TOKEN_METADATA``), so a claim is never lost nor doubled. Transient faults are retried for
``retry_window`` (``gradientmail.mailbox.s3_retry``). A bounded read (``max_bytes``) is one GET of the first
``max_bytes + 1`` bytes, whose answer names the object's size. Details: docs/mailboxes.md.
"""

from __future__ import annotations

import datetime
import logging
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import botocore.config
import botocore.exceptions
import urllib3.exceptions

from gradientmail.errors import MailboxError, UnsafeStoreError, ValueTooLargeError
from gradientmail.mailbox.base import BaseVersionedMailbox
from gradientmail.mailbox.keys import validate_prefix
from gradientmail.mailbox.s3_bucket import bucket_is_missing
from gradientmail.mailbox.s3_client import ProcessClient
from gradientmail.mailbox.s3_common import (
    EMPTY_RANGE_CODE,
    TOKEN_METADATA,
    error_fields,
    first_bytes,
    list_keys,
    stored_size,
)
from gradientmail.mailbox.s3_failures import (
    CONFLICT,
    CONNECT_ERRORS,
    CREDENTIAL_ERRORS,
    EXISTS,
    MISSING,
    REQUEST_ERRORS,
    TRANSIENT,
    UNSUPPORTED,
    denied,
    explain_failure,
    outcome,
)
from gradientmail.mailbox.s3_retry import (
    DEFAULT_RETRY_WINDOW,
    RetryBudget,
    check_retry_window,
    log_recovery,
    log_retry,
)

__all__ = [
    "DEFAULT_BACKOFF",
    "S3Mailbox",
]


_log = logging.getLogger("gradientmail.mailbox")

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
                return _read_body(response), str(response["ETag"])
            size = stored_size(response)
            if size is not None and size > max_bytes:
                response["Body"].close()
                raise ValueTooLargeError(key, max_bytes, size, store=self._store)
            return _read_body(response, max_bytes + 1), str(response["ETag"])

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


_READ_BLOCK = 2**20


def _read_body(response: dict[str, Any], limit: int | None = None) -> bytes:
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
