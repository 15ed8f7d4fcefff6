"""``MemoryMailbox``: an in-process store for tests and notebooks.

Atomicity: one lock guards a dict, so ``put_if_absent`` is atomic among the threads of one
process. Mailboxes with the same ``name`` share one store within a process. The store cannot
cross a process boundary: a forked or spawned worker would silently get a private copy and claim
units nobody else sees, so any use from another process raises ``WrongProcessError``.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import threading
from collections.abc import Iterator

from gradientmail.errors import WrongProcessError
from gradientmail.mailbox.base import verify_mailbox
from gradientmail.mailbox.keys import validate_key, validate_prefix, validate_value


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


class MemoryMailbox:
    """An in-process mailbox; every ``MemoryMailbox(name)`` with the same name shares it."""

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
        return (_unpickle_memory_mailbox, (self.name, self._pid))

    def _checked_store(self) -> _Store:
        if os.getpid() != self._pid:
            raise WrongProcessError(
                f"{self.url} lives in process {self._pid} and cannot be shared with process "
                f"{os.getpid()} (a DataLoader worker or a spawned node would get a private copy). "
                "Use workers=0, or a LocalMailbox / S3 mailbox that every process can reach"
            )
        return self._store

    def put_if_absent(self, key: str, data: bytes) -> bool:
        validate_key(key)
        value = validate_value(data, key)
        store = self._checked_store()
        with store.lock:
            if key in store.values:
                return False
            store.values[key] = value
            bisect.insort(store.sorted_keys, key)
            return True

    # -- compare-and-swap (optional capability, see VersionedMailbox): under the store's lock --
    supports_replace_if = True

    def get_versioned(self, key: str) -> tuple[bytes, str] | None:
        validate_key(key)
        store = self._checked_store()
        with store.lock:
            data = store.values.get(key)
        return None if data is None else (data, hashlib.sha256(data).hexdigest())

    def replace_if(self, key: str, data: bytes, version: str) -> bool:
        validate_key(key)
        value = validate_value(data, key)
        store = self._checked_store()
        with store.lock:
            current = store.values.get(key)
            if current is None or hashlib.sha256(current).hexdigest() != version:
                return False
            store.values[key] = value
            return True

    def put(self, key: str, data: bytes) -> None:
        validate_key(key)
        value = validate_value(data, key)
        store = self._checked_store()
        with store.lock:
            if key not in store.values:
                bisect.insort(store.sorted_keys, key)
            store.values[key] = value

    def get(self, key: str) -> bytes | None:
        validate_key(key)
        store = self._checked_store()
        with store.lock:
            return store.values.get(key)

    def delete(self, key: str) -> None:
        validate_key(key)
        store = self._checked_store()
        with store.lock:
            if store.values.pop(key, None) is not None:
                index = bisect.bisect_left(store.sorted_keys, key)
                del store.sorted_keys[index]

    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        validate_prefix(prefix)
        store = self._checked_store()
        position = max(prefix, start_after) if start_after is not None else prefix
        page = 1000
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

    def verify(self) -> None:
        """Check that conditional creation works here (see ``verify_mailbox``)."""
        verify_mailbox(self)


def _unpickle_memory_mailbox(name: str, pid: int) -> MemoryMailbox:
    mailbox = MemoryMailbox(name)
    mailbox._pid = pid  # a use from any other process raises WrongProcessError
    return mailbox
