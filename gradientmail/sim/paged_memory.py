"""The simulator's fast in-memory mailboxes: listings a page at a time, billed like the real ones.

``PagedCountingMailbox`` counts exactly what ``CountingMailbox`` over a ``MemoryMailbox``
counts (one ``list`` per page asked for), at a fraction of the cost per key. A
``PagedMemoryMailbox`` given the run's ``ClaimIndex`` also knows which units are claimed, so its
pages of claims say which units they name (``IndexedPage``) and a claimer flags a page of a
thousand claims in a few microseconds instead of looking each key up: the simulator's thousand
nodes each list every claim of the run.
"""

from __future__ import annotations

import bisect
import itertools
import sys
from collections.abc import Iterator, Sequence

from gradientmail.mailbox.base import LIST_PAGE
from gradientmail.mailbox.keys import validate_max_bytes, validate_prefix
from gradientmail.mailbox.memory import MemoryMailbox
from gradientmail.mailbox.wrappers import CountingMailbox
from gradientmail.queue.claim_index import ClaimIndex, IndexedPage

__all__ = [
    "PagedCountingMailbox",
    "PagedMemoryMailbox",
]


class PagedMemoryMailbox(MemoryMailbox):
    """A ``MemoryMailbox`` that can also hand out a listing a page at a time, for speed.

    Its keys are interned, like a ``ClaimIndex``'s: a claimer then matches a listed page with its
    index by identity (``ClaimIndex.mark``), not by comparing strings.

    Args:
        name: As ``MemoryMailbox``'s.
        index: The claim index of the run it holds, if any: its claims are then created without
            checking their keys again (the index's keys were checked when the queue was built),
            and its pages of claims are ``IndexedPage`` s. Write the store through this object
            only (another ``MemoryMailbox`` of the same name does not update what it knows).

    Example:
        >>> index = ClaimIndex(["a", "b", "c"])
        >>> box = PagedMemoryMailbox("doctest-paged", index=index)
        >>> box.put_if_absent("units/a", b"1"), box.put_if_absent("units/c", b"1")
        (True, True)
        >>> page = next(box.list_pages("units/"))
        >>> list(page), page.first, page.flags
        (['units/a', 'units/c'], 0, b'\\x01\\x00\\x01')
        >>> box.clear()
    """

    def __init__(self, name: str = "default", *, index: ClaimIndex | None = None) -> None:
        super().__init__(name)
        self._index = index
        self._positions = {} if index is None else index.positions
        self._claimed = bytearray(0 if index is None else len(index))  # 1: the unit's claim exists
        self._prefixes: set[str] = set()  # prefixes already checked

    def put_if_absent(self, key: str, data: bytes) -> bool:
        position = self._positions.get(key)
        if position is None or type(data) is not bytes:
            return super().put_if_absent(key, data)
        store = self._store
        with store.lock:
            if key in store.values:
                return False
            key = self._index.keys[position]  # type: ignore[union-attr]  # the interned object
            store.values[key] = data
            bisect.insort(store.sorted_keys, key)
            self._claimed[position] = 1
            return True

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        if key in self._positions:  # a claim's key: checked when the index was built
            store = self._store
            with store.lock:
                data = store.values.get(key)
            return self._within(key, validate_max_bytes(max_bytes), data)
        return super().get(key, max_bytes=max_bytes)

    def _put_if_absent(self, key: str, value: bytes) -> bool:
        created = super()._put_if_absent(sys.intern(key), value)
        self._flag(key, created)
        return created

    def _put(self, key: str, value: bytes) -> None:
        super()._put(sys.intern(key), value)
        self._flag(key, True)

    def _delete(self, key: str) -> None:
        super()._delete(key)
        position = self._positions.get(key)
        if position is not None:
            self._claimed[position] = 0

    def clear(self) -> None:
        super().clear()
        self._claimed[:] = bytes(len(self._claimed))

    def _flag(self, key: str, present: bool) -> None:
        position = self._positions.get(key)
        if position is not None and present:
            self._claimed[position] = 1

    def list_pages(self, prefix: str = "", start_after: str | None = None) -> Iterator[Sequence[str]]:
        """The keys under ``prefix`` after ``start_after``, ``LIST_PAGE`` at a time (a page of the
        run's claims as an ``IndexedPage``)."""
        after = start_after
        while True:
            page = self.page(prefix, after)
            yield page
            if len(page) < LIST_PAGE:
                return
            after = page[-1]

    def page(self, prefix: str, start_after: str | None) -> Sequence[str]:
        """The first ``LIST_PAGE`` keys under ``prefix`` after ``start_after``: one page of a listing."""
        if prefix not in self._prefixes:
            validate_prefix(prefix)
            self._prefixes.add(prefix)
        if start_after is not None and not isinstance(start_after, str):
            raise TypeError(f"start_after must be a str or None, not {type(start_after).__name__}")
        store = self._checked_store()
        position = max(prefix, start_after) if start_after is not None else prefix
        with store.lock:
            keys = store.sorted_keys
            start = (bisect.bisect_right if position == start_after else bisect.bisect_left)(keys, position)
            end = min(len(keys), start + LIST_PAGE)
            if start < end and self._index is not None:
                # Every key of the store from the page's first to its last: all are the index's
                # claims exactly when as many claims lie in that span (then under the prefix too).
                first, last = self._positions.get(keys[start]), self._positions.get(keys[end - 1])
                if first is not None and last is not None and keys[end - 1].startswith(prefix):
                    flags = bytes(self._claimed[first : last + 1])
                    if flags.count(1) == end - start:
                        return IndexedPage(self._index, first, flags, end - start)
            page = keys[start:end]
        if page and not page[-1].startswith(prefix):  # keys under a prefix are contiguous
            page = page[: bisect.bisect_left(page, prefix + "\U0010ffff")]
            page = [key for key in page if key.startswith(prefix)]
        return page

    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        for page in self.list_pages(prefix, start_after):
            yield from page


class PagedCountingMailbox(CountingMailbox):
    """``CountingMailbox`` with the same bill, listing a page at a time from the store."""

    def __reduce__(self):
        return (PagedCountingMailbox, (self.inner,))

    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        # Keys flow through C (chain), the bill is kept once per page: a generator per key was
        # most of the simulation's own cost per listing.
        return itertools.chain.from_iterable(self.list_pages(prefix, start_after))

    def list_pages(self, prefix: str = "", start_after: str | None = None) -> Iterator[Sequence[str]]:
        """The store's pages, each billed as one ``list`` request when it is asked for."""
        self._count("list")  # the first page is requested even when it comes back empty
        page_of = self.inner.page
        after = start_after
        while True:
            page = page_of(prefix, after)
            yield page
            if len(page) < LIST_PAGE:
                return
            self._count("list")  # asked for more after a full page
            after = page[-1]
