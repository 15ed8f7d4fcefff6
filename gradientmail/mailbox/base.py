"""The ``Mailbox`` protocol, the base class backends build on, and the checks on top of them.

Everything above the mailbox layer (queue, session, CLI) is written against the protocol only, so
any wrapper that follows it (metrics, fault injection) can be passed where a mailbox is accepted.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from gradientmail.errors import UnsafeStoreError, ValueTooLargeError
from gradientmail.mailbox.keys import validate_key, validate_max_bytes, validate_prefix, validate_value

__all__ = [
    "LIST_PAGE",
    "PROBE_PREFIX",
    "BaseMailbox",
    "BaseVersionedMailbox",
    "Mailbox",
    "VersionedMailbox",
    "describe",
    "exists",
    "require_replace_if",
    "supports_replace_if",
    "verify_mailbox",
]

LIST_PAGE = 1000
"""Keys per list page, as in S3's ``ListObjectsV2`` (its maximum): one page is one request."""

PROBE_PREFIX = "_gradientmail/probe/"
"""Where ``verify_mailbox`` writes (and removes) its probe keys."""


@runtime_checkable
class Mailbox(Protocol):
    """A flat key/value store with one hard promise: atomic conditional creation.

    Keys are relative ``/``-separated paths (``units/000003-1.json``), validated before anything
    is written (``gradientmail.mailbox.keys``).
    """

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key``; True if this call created it, False if it existed. Never overwrites.

        Of several racing callers exactly one gets True; readers see no value or the whole one.
        """
        ...

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        """The value of ``key``, or None when it does not exist.

        ``max_bytes`` bounds the read: a longer value is refused with ``ValueTooLargeError``
        after reading at most ``max_bytes + 1`` bytes of it (none where the store tells the size
        first), so a huge value written by anyone costs the reader no memory.
        """
        ...

    def put(self, key: str, data: bytes) -> None:
        """Write ``key`` unconditionally; readers see the whole old or the whole new value."""
        ...

    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        """Keys starting with ``prefix``, sorted, lazily; ``start_after`` skips keys ``<=`` it."""
        ...

    def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is not an error."""
        ...


@runtime_checkable
class VersionedMailbox(Protocol):
    """The optional compare-and-swap: replace a value only if nobody changed it.

    Offered only where the store can do it atomically (``supports_replace_if``); leases, reclaim
    and resume need it. A version names a value, not a write (a SHA-256 or an S3 ETag): callers
    that must tell two writes apart put a unique token in the value.
    """

    def get_versioned(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, str] | None:
        """``(value, version)`` of ``key``, or None when it does not exist; ``max_bytes`` as in ``get``."""
        ...

    def replace_if(self, key: str, data: bytes, version: str) -> bool:
        """Replace ``key`` only if its version is still ``version``; never creates.

        Of several racing callers with one version exactly one gets True.
        """
        ...


class BaseMailbox:
    """Validates keys and values, then calls the backend's raw operations.

    A backend implements only ``_put_if_absent``, ``_get``, ``_put``, ``_delete`` and ``_list``
    (as filelock's platform classes implement only ``_acquire`` / ``_release``), each receiving
    arguments already checked, and states in its docstring what makes its create atomic.

    ``_get(key, max_bytes)`` receives the bound (None: none). Over it, a backend should not read
    the value whole: it raises ``ValueTooLargeError`` (with the size when the store said it) or
    returns the value's first ``max_bytes + 1`` bytes. Whatever it returns, a value longer than
    the bound is refused here, so a backend that ignores the bound is still correct, only not
    bounded in memory.
    """

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """See ``Mailbox.put_if_absent``."""
        return self._put_if_absent(validate_key(key), validate_value(data, key))

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        """See ``Mailbox.get``."""
        validate_key(key)
        limit = validate_max_bytes(max_bytes)
        return self._within(key, limit, self._get(key, limit))

    def put(self, key: str, data: bytes) -> None:
        """See ``Mailbox.put``."""
        self._put(validate_key(key), validate_value(data, key))

    def delete(self, key: str) -> None:
        """See ``Mailbox.delete``."""
        self._delete(validate_key(key))

    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        """See ``Mailbox.list``; the arguments are checked at the call, not at the first key."""
        validate_prefix(prefix)
        if start_after is not None and not isinstance(start_after, str):
            raise TypeError(f"start_after must be a str or None, not {type(start_after).__name__}")
        return self._list(prefix, start_after)

    def verify(self) -> None:
        """Check that conditional creation really works on this store (``verify_mailbox``)."""
        verify_mailbox(self)

    def _within(self, key: str, limit: int | None, data: bytes | None) -> bytes | None:
        """``data``, unless it is longer than ``limit``: then ``ValueTooLargeError``.

        ``data`` may be only the first ``limit + 1`` bytes of the value, so no size is named.
        """
        if limit is not None and data is not None and len(data) > limit:
            raise ValueTooLargeError(key, limit, store=describe(self))
        return data

    # -- the raw operations a backend implements ---------------------------------------------
    def _put_if_absent(self, key: str, data: bytes) -> bool:
        raise NotImplementedError

    def _get(self, key: str, max_bytes: int | None) -> bytes | None:
        raise NotImplementedError

    def _put(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def _delete(self, key: str) -> None:
        raise NotImplementedError

    def _list(self, prefix: str, start_after: str | None) -> Iterator[str]:
        raise NotImplementedError


class BaseVersionedMailbox(BaseMailbox):
    """A ``BaseMailbox`` that also offers compare-and-swap (``VersionedMailbox``).

    Backends add ``_get_versioned`` (which takes the bound as ``_get`` does) and ``_replace_if``.
    """

    supports_replace_if = True

    def get_versioned(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, str] | None:
        """See ``VersionedMailbox.get_versioned``."""
        validate_key(key)
        limit = validate_max_bytes(max_bytes)
        found = self._get_versioned(key, limit)
        if found is not None:
            self._within(key, limit, found[0])
        return found

    def replace_if(self, key: str, data: bytes, version: str) -> bool:
        """See ``VersionedMailbox.replace_if``."""
        validate_key(key)
        data = validate_value(data, key)
        if not isinstance(version, str):
            raise TypeError(f"version must be a str from get_versioned, not {type(version).__name__}")
        return self._replace_if(key, data, version)

    def _get_versioned(self, key: str, max_bytes: int | None) -> tuple[bytes, str] | None:
        raise NotImplementedError

    def _replace_if(self, key: str, data: bytes, version: str) -> bool:
        raise NotImplementedError


def supports_replace_if(mailbox: object) -> bool:
    """Whether ``mailbox`` (or the mailbox a wrapper wraps) offers atomic ``replace_if``."""
    flag = getattr(mailbox, "supports_replace_if", None)
    if flag is not None:
        return bool(flag)
    return callable(getattr(mailbox, "replace_if", None)) and callable(getattr(mailbox, "get_versioned", None))


def require_replace_if(mailbox: object, feature: str) -> VersionedMailbox:
    """``mailbox`` itself when it supports ``replace_if``.

    Raises:
        UnsafeStoreError: it does not; the message names ``feature`` and the stores that do.
    """
    if supports_replace_if(mailbox):
        return mailbox  # type: ignore[return-value]
    store = describe(mailbox)
    raise UnsafeStoreError(
        f"{store}: {feature} needs an atomic compare-and-swap (replace_if) so that exactly one "
        f"node takes over a unit, and {type(mailbox).__name__} does not offer one. Use a "
        "LocalMailbox (a shared directory), an S3Mailbox (If-Match) or a MemoryMailbox, or "
        "run without this option",
        operation="replace_if",
        store=store,
    )


def exists(mailbox: Mailbox, key: str) -> bool:
    """Whether ``key`` holds a value, read with a bound of 0 bytes (a huge one is not loaded)."""
    try:
        return mailbox.get(key, max_bytes=0) is not None
    except ValueTooLargeError:
        return True


def describe(mailbox: object) -> str:
    """A short description of a mailbox for error messages (its URL when it has one)."""
    url = getattr(mailbox, "url", None)
    return str(url) if url else repr(mailbox)


def verify_mailbox(mailbox: Mailbox) -> None:
    """Refuse a store whose ``put_if_absent`` is not really conditional (four requests).

    Some S3-compatible servers silently ignore ``If-None-Match``, so every node would win every
    claim: creating a probe key twice exposes that before any work is claimed.

    Raises:
        UnsafeStoreError: the second create also succeeded, or the probe did not read back whole.
    """
    key = f"{PROBE_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
    data = f"probe {uuid.uuid4().hex}".encode()
    try:
        first = mailbox.put_if_absent(key, data)
        second = mailbox.put_if_absent(key, b"second " + data)
        value = mailbox.get(key)
    finally:
        try:
            mailbox.delete(key)
        except Exception:  # cleanup only; the verdict below is what matters
            pass
    store = describe(mailbox)
    if not first:
        problem = "creating a fresh probe key reported that it already existed; put_if_absent does not report creation truthfully"
    elif second:
        problem = (
            "a second put_if_absent on the same key also succeeded, so this store ignores "
            "conditional writes (If-None-Match) and two nodes could claim one unit. Use a store "
            "that enforces them (AWS S3, MinIO, Cloudflare R2, a local directory)"
        )
    elif value != data:
        problem = (
            f"the probe key did not read back as written ({'missing' if value is None else 'overwritten or partial'})"
        )
    else:
        return
    raise UnsafeStoreError(f"{store}: {problem}", operation="verify", key=key, store=store)
