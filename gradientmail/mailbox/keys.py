"""Argument validation shared by every backend: keys, prefixes, values and read bounds.

Keys are relative, ``/``-separated paths such as ``units/000003-1.json``, checked before anything
is written so that no key escapes the mailbox root or run prefix, and a key means the same on a
filesystem as in an object store. The rules are listed in docs/mailboxes.md.
"""

from __future__ import annotations

import re

from gradientmail.errors import InvalidKeyError, short_repr

MAX_KEY_BYTES = 512
"""Bound on a key's UTF-8 length; leaves room for an S3 run prefix within S3's 1,024 bytes."""
MAX_SEGMENT_BYTES = 255
"""Bound on one ``/``-separated segment: the longest file name ext4, XFS, APFS and NTFS allow."""

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # control characters, DEL included


def _key_problem(text: str, *, allow_trailing_slash: bool) -> str | None:
    """What is wrong with the key (or prefix) ``text``, as "it ...", or None when it is valid."""
    if not isinstance(text, str):
        return f"must be a str, not {type(text).__name__}"
    if len(text.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        return f"is longer than {MAX_KEY_BYTES} bytes"
    if _CONTROL.search(text):
        return "contains a control character"
    if "\\" in text:
        return "contains a backslash (use '/' to separate segments)"
    if text.startswith("/"):
        return "starts with '/' (keys are relative to the mailbox root)"
    body = text[:-1] if allow_trailing_slash and text.endswith("/") else text
    if not body:
        return None if allow_trailing_slash else "is empty"
    for segment in body.split("/"):
        if not segment:
            return "has an empty segment ('//' or a trailing '/')"
        if len(segment.encode("utf-8", "surrogatepass")) > MAX_SEGMENT_BYTES:
            return (
                f"has a segment longer than {MAX_SEGMENT_BYTES} bytes, which no directory can hold as a "
                "file name (a key means the same on every backend)"
            )
        if segment.startswith("."):
            # Covers '.' and '..' (escaping the root) and hidden names, which backends reserve
            # for temporary files that must never show up in list().
            return f"has a segment starting with '.' ({short_repr(segment, 40)})"
    return None


def validate_key(key: str) -> str:
    """``key`` unchanged when it is a valid mailbox key.

    Raises:
        InvalidKeyError: it is not; the message says what is wrong with it.

    Example:
        >>> from gradientmail.mailbox import validate_key
        >>> validate_key("units/000003-1.json")
        'units/000003-1.json'
        >>> validate_key("../escape")
        Traceback (most recent call last):
        ...
        gradientmail.errors.InvalidKeyError: invalid mailbox key '../escape': it has a segment starting with '.' ('..')
    """
    problem = _key_problem(key, allow_trailing_slash=False)
    if problem:
        raise InvalidKeyError(f"invalid mailbox key {short_repr(key)}: it {problem}")
    return key


def is_valid_key(key: object) -> bool:
    """Whether ``key`` would pass ``validate_key``; backends use it to skip foreign objects."""
    return _key_problem(key, allow_trailing_slash=False) is None  # type: ignore[arg-type]


def validate_prefix(prefix: str) -> str:
    """Like ``validate_key`` but allows ``""`` and a trailing ``/`` (``list`` prefixes).

    Raises:
        InvalidKeyError: ``prefix`` is not a valid prefix.
    """
    problem = _key_problem(prefix, allow_trailing_slash=True)
    if problem:
        raise InvalidKeyError(f"invalid mailbox prefix {short_repr(prefix)}: it {problem}")
    return prefix


def validate_value(data: bytes, key: str) -> bytes:
    """``data`` as ``bytes`` (mailbox values are raw bytes).

    Raises:
        TypeError: ``data`` is not bytes-like; the message names ``key``.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"mailbox values are bytes, not {type(data).__name__} (key {key!r})")
    return bytes(data)


def validate_max_bytes(max_bytes: int | None) -> int | None:
    """``max_bytes`` unchanged when it is a bound a read can take: None, or an int >= 0.

    Raises:
        TypeError: it is not an int (a bool is not one here).
        ValueError: it is negative.
    """
    if max_bytes is None:
        return None
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int):
        raise TypeError(f"max_bytes must be an int or None, not {type(max_bytes).__name__}")
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, not {max_bytes}")
    return max_bytes
