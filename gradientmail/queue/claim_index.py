"""The claim keys of a set of units in the store's sorted order, shared by their claimers.

A ``Claimer`` works on sorted positions, not identifiers: a listing comes back in key order,
and a position is 4 bytes where an identifier is tens.
"""

from __future__ import annotations

import itertools
import sys
import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from gradientmail.layout import CLAIMS_PREFIX, claim_key, summary_key

__all__ = [
    "ClaimIndex",
    "IndexedPage",
    "PositionOrder",
]


_ONES = b"\x01" * 1000  # a full page of claims
_GALLOP_GAPS = 16
"""``mark`` matches a page run by run when it spans at most this many unlisted positions (so at
most this many runs plus one); more gaps, and a lookup per key is cheaper (about 50 us a page
against about 2 us a run)."""


class ClaimIndex:
    """The claim keys of one set of units in the store's sorted order, and each key's position.

    Building it sorts every key; claimers of the same units (the nodes of a simulation, or the
    workers of one node) can share one.

    Raises:
        ValueError: two identifiers are the same.

    Example:
        >>> index = ClaimIndex(["b", "a"])
        >>> index.keys, list(index.order(["b", "a"]))
        (['units/a', 'units/b'], [1, 0])
    """

    def __init__(self, identifiers: Iterable[str]) -> None:
        named = sorted((claim_key(identifier), identifier) for identifier in identifiers)
        # Interned: a store that interns its keys too (the simulator's) then lists the same
        # objects, and ``mark`` compares a page with the index at the speed of pointers.
        self.keys: list[str] = [sys.intern(key) for key, _ in named]
        self.positions: dict[str, int] = {key: position for position, key in enumerate(self.keys)}
        self._by_identifier = {identifier: position for position, (_, identifier) in enumerate(named)}
        if len(self.positions) != len(self.keys):
            raise ValueError("unit identifiers must be unique")
        self._summaries: dict[int, dict[str, int]] = {}

    def summary_keys(self, size: int) -> dict[str, int]:
        """Each span's summary key (``layout.summary_key``) and the span: spans are ``size``
        consecutive sorted positions (the last one shorter), ``span * size`` on.

        The key's check is the CRC-32 of the span's size and first and last claim keys: the same
        span of the same units, the same key, on every node; a span of another unit set or size
        gets another check (a claimer ignores keys that are not in this mapping). Computed once
        per size and shared by the index's claimers.

        Example:
            >>> index = ClaimIndex(["a", "b", "c"])
            >>> sorted(index.summary_keys(2).values())
            [0, 1]
        """
        keys = self._summaries.get(size)
        if keys is None:
            if size < 1:
                raise ValueError(f"size must be >= 1, not {size}")
            keys = {}
            for span, first in enumerate(range(0, len(self.keys), size)):
                last = min(len(self.keys), first + size) - 1
                check = zlib.crc32(f"{size}\0{self.keys[first]}\0{self.keys[last]}".encode())
                keys[summary_key(span, check)] = span
            self._summaries[size] = keys
        return keys

    def __len__(self) -> int:
        return len(self.keys)

    def order(self, identifiers: Iterable[str]) -> Sequence[int]:
        """The sorted positions of ``identifiers``, in their order.

        A ``PositionOrder`` over this index gives its positions as they are: no lookup per unit
        (the simulator's thousand nodes each pass one).
        """
        if isinstance(identifiers, PositionOrder) and identifiers.index is self:
            return identifiers.positions
        return list(map(self._by_identifier.__getitem__, identifiers))

    def mark(self, page: list[str], known: bytearray) -> int:
        """Flag in ``known`` every unit of this index that ``page`` (sorted keys) names.

        A listing's page is mostly runs of consecutive claim keys: each run is found by a
        binary search and checked whole against the index's keys, then flagged as one slice,
        instead of a lookup per key. Keys that are not this index's are ignored.

        Returns:
            How many of those units ``known`` did not flag before.

        Example:
            >>> index = ClaimIndex(["a", "b", "c", "d"])
            >>> known = bytearray(4)
            >>> index.mark(["units/a", "units/b", "units/d", "units/zz"], known), known
            (3, bytearray(b'\\x01\\x01\\x00\\x01'))
        """
        if type(page) is IndexedPage and page.index is self:
            # The store said which positions the page holds: one OR over its span, no key looked up.
            first, flags = page.first, page.flags
            end = first + len(flags)
            before = known[first:end]
            merged = (int.from_bytes(before, "little") | int.from_bytes(flags, "little")).to_bytes(len(flags), "little")
            known[first:end] = merged
            return merged.count(1) - before.count(1)
        keys = self.keys
        positions = self.positions
        size = len(page)
        if not size:
            return 0
        first, last = positions.get(page[0]), positions.get(page[-1])
        if first is None or last is None or last - first + 1 > size + _GALLOP_GAPS:
            # Sparse (the run's frontier) or foreign keys at the ends: a lookup per key, in C
            # but for the claims new to ``known``.
            new = [q for q in map(positions.get, page) if q is not None and not known[q]]
            for q in new:
                known[q] = 1
            return len(new)
        count = 0
        index = 0
        while index < size:
            first = positions.get(page[index])
            if first is None:
                index += 1
                continue
            # The longest run page[index:index + length] == keys[first:first + length]: the
            # page is a sorted subset of the keys, so it matches up to its first gap. Runs are
            # short at the run's frontier, long behind it: gallop, then bisect.
            limit = min(size - index, len(keys) - first)
            low, step = 1, 1
            while low < limit:
                probe = min(limit, low + step)
                if page[index + probe - 1] != keys[first + probe - 1]:
                    high = probe - 1
                    break
                low, step = probe, step * 2
            else:
                high = low
            while low < high:
                middle = (low + high + 1) // 2
                if page[index + middle - 1] == keys[first + middle - 1]:
                    low = middle
                else:
                    high = middle - 1
            if low > 1 and page[index : index + low] != keys[first : first + low]:
                low = 1  # a key that is not a unit inside the run: one key at a time here
            end = first + low
            count += low - known.count(1, first, end)
            known[first:end] = _ONES if low == len(_ONES) else b"\x01" * low
            index += low
        return count


class IndexedPage(Sequence[str]):
    """A page of a claim listing held as the positions of ``index`` it names.

    A store that knows the claim index (the simulator's, ``paged_memory``) hands these out so
    that ``ClaimIndex.mark`` flags a page with one OR over its span instead of a lookup per
    key: ``flags[i]`` is 1 when the page names ``index.keys[first + i]``. The keys themselves
    are made only if something reads them, in order, as from any page. ``flags`` must start and
    end with a 1 (a page spans its first to its last key; not checked here).

    Example:
        >>> index = ClaimIndex(["a", "b", "c"])
        >>> page = IndexedPage(index, 0, b"\\x01\\x00\\x01")
        >>> len(page), page[-1], list(page)
        (2, 'units/c', ['units/a', 'units/c'])
        >>> known = bytearray(3)
        >>> index.mark(page, known), known
        (2, bytearray(b'\\x01\\x00\\x01'))
    """

    __slots__ = ("_keys", "_size", "first", "flags", "index")

    def __init__(self, index: ClaimIndex, first: int, flags: bytes, size: int | None = None) -> None:
        self.index = index
        self.first = first
        self.flags = flags
        self._size = flags.count(1) if size is None else size
        self._keys: list[str] | None = None

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, item: Any) -> Any:
        if item == -1 and self._size:  # what a claimer reads of a full page: its last key
            return self.index.keys[self.first + len(self.flags) - 1]
        return self.keys()[item]

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __repr__(self) -> str:
        return f"IndexedPage({self.keys()!r})"

    def keys(self) -> list[str]:
        """The page's keys, in order."""
        if self._keys is None:
            span = self.index.keys[self.first : self.first + len(self.flags)]
            self._keys = list(itertools.compress(span, self.flags))
        return self._keys


class PositionOrder(Sequence[str]):
    """A preference order held as sorted positions in a ``ClaimIndex``: identifiers on demand.

    A list of a million identifiers costs each node tens of MB and a lookup per unit to turn
    into positions; an ``array("i")`` of positions costs 4 bytes a unit. ``positions`` must be
    a permutation of ``range(len(index))`` (not checked: the caller built it from the index).
    ``run_starts``, if given, are where its runs of consecutive positions start
    (``order_runs.OrderRuns``), which the simulator computes for a thousand orders at once.
    """

    def __init__(self, index: ClaimIndex, positions: Sequence[int], run_starts: Sequence[int] | None = None) -> None:
        if len(positions) != len(index):
            raise ValueError(f"{len(positions)} positions for an index of {len(index)} units")
        self.index = index
        self.positions = positions
        self.run_starts = run_starts

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, item: Any) -> Any:
        keys = self.index.keys
        if isinstance(item, slice):
            return [keys[position][len(CLAIMS_PREFIX) :] for position in self.positions[item]]
        return keys[self.positions[item]][len(CLAIMS_PREFIX) :]
