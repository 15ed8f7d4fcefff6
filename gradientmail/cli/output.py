"""What a command writes: strict JSON documents and a rich console."""

from __future__ import annotations

import json
import math
from typing import Any

from gradientmail.errors import MissingExtraError

__all__ = ["console", "json_document"]


def json_document(value: Any, **options: Any) -> str:
    """``value`` as strict JSON: a non-finite float (no record should hold one) becomes null.

    Example:
        >>> json_document({"rate": float("nan"), "units": [1, 2]})
        '{"rate": null, "units": [1, 2]}'
    """
    return json.dumps(_finite(value), allow_nan=False, **options)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def console():
    """A rich ``Console``; ``MissingExtraError`` with the install hint when rich is missing."""
    try:
        from rich.console import Console
    except ImportError as exc:
        raise MissingExtraError(f"this command needs rich: pip install 'gradientmail[cli]' ({exc})") from exc
    return Console()
