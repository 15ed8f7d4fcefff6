"""The ``Mailbox`` protocol and the checks built on its five primitives.

Every backend implements the same five methods; everything else in GradientMail (the shared queue,
the session, the CLI) is written against this protocol only, so a user can wrap any mailbox for
metrics or fault injection and pass the wrapper anywhere a mailbox is accepted.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from gradientmail.errors import UnsafeStoreError


@runtime_checkable
class Mailbox(Protocol):
    """A flat key/value store with one hard promise: atomic conditional creation.

    Keys are relative ``/``-separated paths (``units/000003-1.json``), validated by every backend
    before anything is written.
    """

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` with ``data``; True if this call created it, False if it existed.

        Never overwrites. When several processes race on one key exactly one gets True, and
        every reader sees either no value or the whole value.
        """
        ...

    def get(self, key: str) -> bytes | None:
        """The value of ``key``, or None when it does not exist."""
        ...

    def put(self, key: str, data: bytes) -> None:
        """Write ``key`` unconditionally; readers see the whole old or the whole new value."""
        ...

    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        """Keys starting with ``prefix`` (a string prefix), in lexicographic order, lazily.

        ``start_after`` skips every key ``<=`` it, so a caller can resume a listing cheaply.
        """
        ...

    def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is not an error."""
        ...


@runtime_checkable
class VersionedMailbox(Protocol):
    """The optional compare-and-swap capability: replace a value only if nobody changed it.

    Not part of ``Mailbox``: a backend offers it only where the store can do it atomically
    (``supports_replace_if``). Leases, reclaim and resume in the shared queue need it.

    A version names a value, not a write: ``LocalMailbox`` and ``MemoryMailbox`` use the
    value's SHA-256 and S3 its ETag (the MD5 of a plain upload), so writing back identical
    bytes gives the same version. Callers that must tell two writes apart put a unique token
    in the value (claims do).
    """

    def get_versioned(self, key: str) -> tuple[bytes, str] | None:
        """``(value, version)`` of ``key``, or None when it does not exist."""
        ...

    def replace_if(self, key: str, data: bytes, version: str) -> bool:
        """Replace ``key`` with ``data`` only if its current version is ``version``.

        True when this call replaced it, atomically with the comparison; False when the key
        changed since, or does not exist (never creates). When several callers race with the
        same version exactly one gets True. Atomic with respect to ``put_if_absent`` and other
        ``replace_if`` calls on the key.
        """
        ...


def supports_replace_if(mailbox: object) -> bool:
    """Whether ``mailbox`` (or the mailbox a wrapper wraps) offers atomic ``replace_if``."""
    flag = getattr(mailbox, "supports_replace_if", None)
    if flag is not None:
        return bool(flag)
    return callable(getattr(mailbox, "replace_if", None)) and callable(getattr(mailbox, "get_versioned", None))


def require_replace_if(mailbox: object, feature: str) -> VersionedMailbox:
    """``mailbox`` itself when it supports ``replace_if``; else ``UnsafeStoreError`` naming it."""
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


PROBE_PREFIX = "_gradientmail/probe/"


def describe(mailbox: object) -> str:
    """A short human description of a mailbox for error messages (its URL when it has one)."""
    url = getattr(mailbox, "url", None)
    return str(url) if url else repr(mailbox)


def verify_mailbox(mailbox: Mailbox) -> None:
    """Refuse a store whose ``put_if_absent`` is not really conditional.

    Some S3-compatible servers silently ignore ``If-None-Match``: every node would then "win"
    every claim. Creating a probe key twice exposes that before any work is claimed: the second
    create must return False and the value must read back whole. Costs four requests.
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
        raise UnsafeStoreError(
            f"{store}: creating a fresh probe key reported that it already existed; "
            "put_if_absent does not report creation truthfully",
            operation="verify",
            key=key,
            store=store,
        )
    if second:
        raise UnsafeStoreError(
            f"{store}: a second put_if_absent on the same key also succeeded, so this store "
            "ignores conditional writes (If-None-Match) and two nodes could claim one unit. "
            "Use a store that enforces them (AWS S3, MinIO, Cloudflare R2, a local directory)",
            operation="verify",
            key=key,
            store=store,
        )
    if value != data:
        raise UnsafeStoreError(
            f"{store}: the probe key did not read back as written "
            f"({'missing' if value is None else 'overwritten or partial'})",
            operation="verify",
            key=key,
            store=store,
        )
