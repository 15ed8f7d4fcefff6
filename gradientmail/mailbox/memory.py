"""``MemoryMailbox``: an in-process store for tests and notebooks.

Atomicity: one lock guards a dict, so ``put_if_absent`` is atomic among the threads of one
process. A forked or spawned worker would get a private copy, so any use from another process
raises ``WrongProcessError``.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import threading
from collections.abc import Iterator

from gradientmail.errors import ValueTooLargeError, WrongProcessError
from gradientmail.mailbox.base import LIST_PAGE, BaseVersionedMailbox


class _Store:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values: dict[str, bytes] = {}
        self.sorted_keys: list[str] = []


_STORES: dict[str, _Store] = {}
_STORES_LOCK = threading.Lock()


def _store_named(name: str) -> _Store:
    with _STORES_LOCK:
        return _STORES.setdefault(name, _Store())


class MemoryMailbox(BaseVersionedMailbox):
    """An in-process mailbox; every ``MemoryMailbox(name)`` of one process with the same name shares it.

    Args:
        name: The store's name (``open_mailbox("memory://name")`` opens the same one).

    Raises:
        WrongProcessError: on any use from another process than the one that created it.

    Example:
        >>> from gradientmail.mailbox import MemoryMailbox
        >>> box = MemoryMailbox("doctest-memory")
        >>> box.clear()
        >>> box.put_if_absent("units/1", b"mine"), box.put_if_absent("units/1", b"yours")
        (True, False)
        >>> box.get("units/1"), list(box.list("units/"))
        (b'mine', ['units/1'])
    """

    def __init__(self, name: str = "default") -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"MemoryMailbox name must be a non-empty str, not {name!r}")
        self.name = name
        self._pid = os.getpid()
        self._store = _store_named(name)

    @property
    def url(self) -> str:
        return f"memory://{self.name}"

    def __repr__(self) -> str:
        return f"MemoryMailbox({self.name!r})"

    def __reduce__(self):
        # The creating process travels with the copy: a use from any other process raises
        # WrongProcessError (the store itself does not travel).
        return (MemoryMailbox, (self.name,), {"pid": self._pid})

    def __setstate__(self, state: dict[str, int]) -> None:
        self._pid = state["pid"]

    def _checked_store(self) -> _Store:
        if os.getpid() != self._pid:
            raise WrongProcessError(
                f"{self.url} lives in process {self._pid} and cannot be shared with process "
                f"{os.getpid()} (a DataLoader worker or a spawned node would get a private copy). "
                "Use workers=0, or a LocalMailbox / S3 mailbox that every process can reach"
            )
        return self._store

    def _put_if_absent(self, key: str, value: bytes) -> bool:
        store = self._checked_store()
        with store.lock:
            if key in store.values:
                return False
            store.values[key] = value
            bisect.insort(store.sorted_keys, key)
            return True

    # -- compare-and-swap (see VersionedMailbox): under the store's lock ----------------------
    def _get_versioned(self, key: str, max_bytes: int | None) -> tuple[bytes, str] | None:
        data = self._get(key, max_bytes)
        return None if data is None else (data, hashlib.sha256(data).hexdigest())

    def _replace_if(self, key: str, value: bytes, version: str) -> bool:
        store = self._checked_store()
        with store.lock:
            current = store.values.get(key)
            if current is None or hashlib.sha256(current).hexdigest() != version:
                return False
            store.values[key] = value
            return True

    def _put(self, key: str, value: bytes) -> None:
        store = self._checked_store()
        with store.lock:
            if key not in store.values:
                bisect.insort(store.sorted_keys, key)
            store.values[key] = value

    def _get(self, key: str, max_bytes: int | None) -> bytes | None:
        store = self._checked_store()
        with store.lock:
            data = store.values.get(key)
        if max_bytes is not None and data is not None and len(data) > max_bytes:
            raise ValueTooLargeError(key, max_bytes, len(data), store=self.url)
        return data

    def _delete(self, key: str) -> None:
        store = self._checked_store()
        with store.lock:
            if store.values.pop(key, None) is not None:
                index = bisect.bisect_left(store.sorted_keys, key)
                del store.sorted_keys[index]

    def _list(self, prefix: str, start_after: str | None) -> Iterator[str]:
        store = self._checked_store()
        position = max(prefix, start_after) if start_after is not None else prefix
        page = LIST_PAGE
        while True:
            with store.lock:
                keys = store.sorted_keys
                index = (bisect.bisect_right if position == start_after else bisect.bisect_left)(keys, position)
                chunk = keys[index : index + page]
            for key in chunk:
                if not key.startswith(prefix):
                    return
                yield key
            if len(chunk) < page:
                return
            position = start_after = chunk[-1]

    def clear(self) -> None:
        """Forget every key (tests and notebooks reuse names)."""
        store = self._checked_store()
        with store.lock:
            store.values.clear()
            store.sorted_keys.clear()
