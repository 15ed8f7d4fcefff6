"""The retry window: how long, and how often, ``S3Mailbox`` retries one operation's transient faults.

Transient faults are retried until ``retry_window`` has passed since the first failure, with
capped, fully jittered backoff (nodes neither give up early nor retry in lockstep); an endpoint
that never answered gets ``FIRST_CONTACT_ATTEMPTS`` rounds. See docs/mailboxes.md.
"""

from __future__ import annotations

import datetime
import logging
import random
import time
from typing import Any

from gradientmail.mailbox.s3_failures import root_cause

__all__ = [
    "check_retry_window",
    "DEFAULT_RETRY_WINDOW",
    "FIRST_CONTACT_ATTEMPTS",
    "log_recovery",
    "log_retry",
    "MAX_BACKOFF",
    "RetryBudget",
]


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
