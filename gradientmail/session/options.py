"""A Session's options: defaults, environment overrides and validation (one place for each)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

DEFAULT_EVERY = timedelta(seconds=30)
"""Exchange interval: by time, so every node's cadence is equal whatever its speed."""

DEFAULT_MAX_STALENESS = timedelta(minutes=5)
"""Ten exchange intervals: a peer whose newest mail is older than this has stopped counting."""

DEFAULT_TIMEOUT = timedelta(minutes=5)
"""Longest wait for the background thread before a ``SessionError`` (mailbox not answering)."""

ENV_EVERY = "GRADIENTMAIL_SESSION_EVERY_S"
ENV_EVERY_STEPS = "GRADIENTMAIL_SESSION_EVERY_STEPS"
ENV_MAX_STALENESS = "GRADIENTMAIL_SESSION_MAX_STALENESS_S"
ENV_TIMEOUT = "GRADIENTMAIL_SESSION_TIMEOUT_S"
ENV_OUTER = "GRADIENTMAIL_SESSION_OUTER"
ENV_FRAGMENTS = "GRADIENTMAIL_SESSION_FRAGMENTS"
"""Environment overrides of the matching argument (seconds or steps; ``none`` disables one)."""
ENV_RETIRE_AFTER = "GRADIENTMAIL_SESSION_RETIRE_AFTER_S"
"""Seconds a superseded version stays readable (``session.chain.MIN_AGE_S``, 10 by default):
more for readers far from the store or reading very large fragments, less to store fewer
copies of a fast chain."""


def retire_after_s(default: float) -> float:
    """``ENV_RETIRE_AFTER`` when set (seconds, >= 0), else ``default``."""
    text = os.environ.get(ENV_RETIRE_AFTER, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0 or math.isinf(value):
        raise ValueError(f"{ENV_RETIRE_AFTER}={text!r}: expected seconds >= 0")
    return value


def env_override(name: str, value: Any, parse: Callable[[str], Any], expected: str) -> Any:
    """``value``, or the environment variable ``name`` parsed when set (``none``: None)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return value
    if text.lower() == "none":
        return None
    try:
        return parse(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected {expected} or 'none'") from None


def seconds(text: str) -> timedelta:
    return timedelta(seconds=float(text))


def positive_seconds(name: str, value: timedelta | None, *, optional: bool = False) -> float:
    if value is None and optional:
        return math.inf
    if not isinstance(value, timedelta):
        raise TypeError(f"{name} must be a datetime.timedelta, not {type(value).__name__}")
    total = value.total_seconds()
    if total <= 0:
        raise ValueError(f"{name} must be positive, not {value}")
    return total
