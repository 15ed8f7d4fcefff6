"""Mailbox wrappers for measuring and testing: request counts, latency, injected faults.

Each wraps any object that follows the ``Mailbox`` protocol and is itself one, which is the
point of the protocol: code that takes a mailbox never needs to know it is wrapped.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from gradientmail.mailbox.base import LIST_PAGE, Mailbox, describe, supports_replace_if

__all__ = ["CountingMailbox", "DelayedMailbox", "FaultyMailbox", "MailboxWrapper"]


class MailboxWrapper:
    """Forwards every operation to ``inner``; subclass it and override what you measure or break.

    The optional compare-and-swap is forwarded when ``inner`` has it.

    Example:
        >>> from gradientmail.mailbox import MemoryMailbox
        >>> from gradientmail.mailbox.wrappers import MailboxWrapper
        >>> wrapped = MailboxWrapper(MemoryMailbox("doctest-wrapper"))
        >>> wrapped.url, wrapped.supports_replace_if
        ('memory://doctest-wrapper', True)
    """

    def __init__(self, inner: Mailbox) -> None:
        self.inner = inner

    @property
    def url(self) -> str | None:
        """The wrapped store's URL (None when it has none: a description is not an address)."""
        return getattr(self.inner, "url", None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({describe(self.inner)})"

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self.inner.put_if_absent(key, data)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        return self.inner.get(key, max_bytes=max_bytes)

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)

    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        return self.inner.list(prefix, start_after)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    # The optional compare-and-swap, forwarded when the wrapped mailbox has it.
    @property
    def supports_replace_if(self) -> bool:
        return supports_replace_if(self.inner)

    def _versioned(self) -> Any:
        if not supports_replace_if(self.inner):
            raise NotImplementedError(f"{describe(self.inner)} ({type(self.inner).__name__}) has no replace_if")
        return self.inner

    def get_versioned(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, str] | None:
        return self._versioned().get_versioned(key, max_bytes=max_bytes)

    def replace_if(self, key: str, data: bytes, version: str) -> bool:
        return self._versioned().replace_if(key, data, version)


class CountingMailbox(MailboxWrapper):
    """Counts requests by operation as an object store would bill them.

    A ``list`` is charged one request per started page of ``LIST_PAGE`` keys, and only for the
    pages the caller actually consumed (listings are lazy). Counts are per process.
    ``bytes_read`` and ``bytes_written`` add up the values that went each way; a read refused
    for its bound (``max_bytes``) counts as a request that returned nothing.
    """

    def __init__(self, inner: Mailbox) -> None:
        super().__init__(inner)
        self.counts: Counter[str] = Counter()
        self.bytes_read = 0
        self.bytes_written = 0
        self._lock = threading.Lock()

    def __reduce__(self):
        return (CountingMailbox, (self.inner,))

    def _count(self, operation: str) -> None:
        with self._lock:
            self.counts[operation] += 1

    @property
    def requests(self) -> int:
        """Total requests so far."""
        return sum(self.counts.values())

    def _moved(self, read: int = 0, written: int = 0) -> None:
        with self._lock:
            self.bytes_read += read
            self.bytes_written += written

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self._count("put_if_absent")
        self._moved(written=len(data))
        return self.inner.put_if_absent(key, data)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        self._count("get")
        data = self.inner.get(key, max_bytes=max_bytes)
        self._moved(read=0 if data is None else len(data))
        return data

    def put(self, key: str, data: bytes) -> None:
        self._count("put")
        self._moved(written=len(data))
        self.inner.put(key, data)

    def delete(self, key: str) -> None:
        self._count("delete")
        self.inner.delete(key)

    def get_versioned(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, str] | None:
        inner = self._versioned()
        self._count("get_versioned")
        found = inner.get_versioned(key, max_bytes=max_bytes)
        self._moved(read=0 if found is None else len(found[0]))
        return found

    def replace_if(self, key: str, data: bytes, version: str) -> bool:
        inner = self._versioned()
        self._count("replace_if")
        self._moved(written=len(data))
        return inner.replace_if(key, data, version)

    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        self._count("list")  # the first page is requested even when it comes back empty
        for seen, key in enumerate(self.inner.list(prefix, start_after), start=1):
            yield key
            if seen % LIST_PAGE == 0:
                self._count("list")


class DelayedMailbox(MailboxWrapper):
    """Adds ``latency`` seconds to every request (and to every list page), like a far store."""

    def __init__(self, inner: Mailbox, latency: float) -> None:
        super().__init__(inner)
        if latency < 0:
            raise ValueError(f"latency must be >= 0, not {latency}")
        self.latency = latency

    def __reduce__(self):
        return (DelayedMailbox, (self.inner, self.latency))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        time.sleep(self.latency)
        return self.inner.put_if_absent(key, data)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        time.sleep(self.latency)
        return self.inner.get(key, max_bytes=max_bytes)

    def put(self, key: str, data: bytes) -> None:
        time.sleep(self.latency)
        self.inner.put(key, data)

    def delete(self, key: str) -> None:
        time.sleep(self.latency)
        self.inner.delete(key)

    def get_versioned(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, str] | None:
        inner = self._versioned()
        time.sleep(self.latency)
        return inner.get_versioned(key, max_bytes=max_bytes)

    def replace_if(self, key: str, data: bytes, version: str) -> bool:
        inner = self._versioned()
        time.sleep(self.latency)
        return inner.replace_if(key, data, version)

    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        time.sleep(self.latency)
        for seen, key in enumerate(self.inner.list(prefix, start_after), start=1):
            yield key
            if seen % LIST_PAGE == 0:
                time.sleep(self.latency)


class FaultyMailbox(MailboxWrapper):
    """Raises ``fault(operation, key)``'s exception when it returns one; for tests.

    ``fault`` is called before each request with the operation name and key (the prefix for
    ``list``); return an exception instance to raise it instead of performing the request, or
    None to let the request through.
    """

    def __init__(self, inner: Mailbox, fault: Callable[[str, str], BaseException | None]) -> None:
        super().__init__(inner)
        self.fault = fault

    def __reduce__(self):
        return (FaultyMailbox, (self.inner, self.fault))

    def _check(self, operation: str, key: str) -> None:
        error = self.fault(operation, key)
        if error is not None:
            raise error

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self._check("put_if_absent", key)
        return self.inner.put_if_absent(key, data)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        self._check("get", key)
        return self.inner.get(key, max_bytes=max_bytes)

    def put(self, key: str, data: bytes) -> None:
        self._check("put", key)
        self.inner.put(key, data)

    def delete(self, key: str) -> None:
        self._check("delete", key)
        self.inner.delete(key)

    def get_versioned(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, str] | None:
        inner = self._versioned()
        self._check("get_versioned", key)
        return inner.get_versioned(key, max_bytes=max_bytes)

    def replace_if(self, key: str, data: bytes, version: str) -> bool:
        inner = self._versioned()
        self._check("replace_if", key)
        return inner.replace_if(key, data, version)

    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        self._check("list", prefix)
        return self.inner.list(prefix, start_after)
