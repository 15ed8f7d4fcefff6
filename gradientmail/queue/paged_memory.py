"""The simulator's fast in-memory mailboxes: listings a page at a time, billed like the real ones.

``PagedCountingMailbox`` counts exactly what ``CountingMailbox`` over a ``MemoryMailbox``
counts (one ``list`` per page asked for), at a fraction of the cost per key.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator

from gradientmail.mailbox.keys import validate_prefix
from gradientmail.mailbox.memory import MemoryMailbox
from gradientmail.mailbox.wrappers import LIST_PAGE, CountingMailbox

__all__ = ["PagedCountingMailbox", "PagedMemoryMailbox"]


class PagedMemoryMailbox(MemoryMailbox):
    """A ``MemoryMailbox`` that can also hand out a listing a page at a time, for speed."""

    def list_pages(self, prefix: str = "", start_after: str | None = None) -> Iterator[list[str]]:
        validate_prefix(prefix)
        store = self._checked_store()
        position = max(prefix, start_after) if start_after is not None else prefix
        after = start_after is not None and position == start_after
        while True:
            with store.lock:
                keys = store.sorted_keys
                start = (bisect.bisect_right if after else bisect.bisect_left)(keys, position)
                page = keys[start : start + LIST_PAGE]
            if page and not page[-1].startswith(prefix):  # keys under a prefix are contiguous
                page = page[: bisect.bisect_left(page, prefix + "\U0010ffff")]
                page = [key for key in page if key.startswith(prefix)]
                yield page
                return
            yield page
            if len(page) < LIST_PAGE:
                return
            position, after = page[-1], True

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
        return itertools.chain.from_iterable(self._pages(prefix, start_after))

    def _pages(self, prefix: str, start_after: str | None) -> Iterator[list[str]]:
        self._count("list")  # the first page is requested even when it comes back empty
        for page in self.inner.list_pages(prefix, start_after):
            yield page
            if len(page) < LIST_PAGE:
                return
            self._count("list")  # asked for more after a full page
