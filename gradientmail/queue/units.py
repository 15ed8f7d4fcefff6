"""Work units, the orders nodes prefer them in, and their places among the store's keys.

Section ``units`` below: Work units for the shared queue: the design note's grid of (step group, lane) units, and orders.

A unit's *identifier* is what nodes agree on in the mailbox; its *value* is whatever the local
loader needs (here a ``Unit``). The queue never interprets values.

Section ``claim_index`` below: The claim keys of a set of units in the store's sorted order, shared by their claimers.

A ``Claimer`` works on sorted positions, not identifiers: a listing comes back in key order,
and a position is 4 bytes where an identifier is tens.

Section ``order_runs`` below: A preference order as runs of consecutive sorted positions: skipping known claims in bulk.

A ``Claimer`` walks its order past every unit it knows is claimed. Walked one unit at a time,
that is a Python step per unit of the whole run for every node; a simulation of 1,024 nodes over
1M units spent most of its time there. An order of claim positions (``ClaimIndex``) is mostly
made of runs of consecutive positions (``rotated_order`` helps a group of units in key order, the
mapping's order is one run), and inside a run the next free unit is one ``bytearray.find`` (or
``rfind`` for a descending run) over the claimer's flags: the walk costs a step per run, not per
unit, and picks exactly what the unit-by-unit walk picks.
"""

from __future__ import annotations

import bisect
import itertools
import sys
import zlib
from array import array
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from gradientmail.layout import CLAIMS_PREFIX, claim_key, summary_key

__all__ = ["ClaimIndex", "IndexedPage", "OrderRuns", "PositionOrder"]


# -- units -------------------------------------------------------------------------------------------
K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Unit:
    """``count`` consecutive dataset steps from ``first``, one ``lane`` of ``lanes`` per step.

    ``Unit(first=0, count=20, lane=2, lanes=4)`` is the third quarter of each step's batch at
    steps 0 to 19. The lane names the data, not the machine: any node can process any unit.
    """

    first: int
    count: int
    lane: int
    lanes: int


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, not {value!r}")
    return value


def unit_grid(steps: int, unit_steps: int, lanes: int) -> dict[str, Unit]:
    """The design note's grid: every group of ``unit_steps`` steps split into ``lanes`` units.

    Identifiers are ``f"{first // unit_steps:06d}-{lane}.json"``, in group-major order, so the
    mapping's order (and the mailbox's sorted listing) walks the run from its first step::

        >>> list(unit_grid(steps=40, unit_steps=20, lanes=2))
        ['000000-0.json', '000000-1.json', '000001-0.json', '000001-1.json']

    The last group is shorter when ``unit_steps`` does not divide ``steps``.
    """
    _positive_int("steps", steps)
    _positive_int("unit_steps", unit_steps)
    _positive_int("lanes", lanes)
    return {
        f"{first // unit_steps:06d}-{lane}.json": Unit(
            first=first,
            count=min(unit_steps, steps - first),
            lane=lane,
            lanes=lanes,
        )
        for first in range(0, steps, unit_steps)
        for lane in range(lanes)
    }


DEFAULT_BLOCK = 4
"""``rotated_order``'s default ``block``: groups of steps a node works through in its own lane."""

DEFAULT_LAG = 1
"""``rotated_order``'s default ``lag``: blocks by which helping another lane is delayed."""


def rotated_order(
    identifiers: Iterable[K],
    rank: int,
    lanes: int,
    *,
    block: int = DEFAULT_BLOCK,
    lag: int = DEFAULT_LAG,
) -> list[K]:
    """Node ``rank``'s preference: its own lane first, the other lanes later, in step order.

    A permutation of ``identifiers`` (groups of ``lanes`` consecutive units, ``unit_grid``'s
    order; a mapping's keys): every node still shares every unit. Per ``block`` groups the node
    walks its own lane, then helps the other lanes of the block ``lag`` blocks earlier from its
    far end: group by group from the block's last, each group's other units in key order from
    just after its own one, wrapping around. So nodes that help at the same moment start on
    different lanes, each on the units their owners reach last; and a group's other units are
    consecutive claim keys, which one listing covers and the claimer skips in bulk
    (``order_runs``). Pass it as ``order=``.

    Args:
        identifiers: The units, group by group.
        rank: The node; its own lane is ``rank % lanes``.
        lanes: Units per group.
        block: Groups walked per stretch of its own lane.
        lag: Blocks by which helping another lane is delayed.

    Example:
        >>> rotated_order(["a0", "a1", "b0", "b1", "c0", "c1", "d0", "d1"], 0, 2, block=2, lag=1)
        ['a0', 'b0', 'c0', 'd0', 'b1', 'a1', 'd1', 'c1']
        >>> rotated_order(["a0", "a1", "a2", "b0", "b1", "b2"], rank=1, lanes=3, block=1, lag=0)
        ['a1', 'a2', 'a0', 'b1', 'b2', 'b0']
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be an int >= 0, not {rank!r}")
    _positive_int("lanes", lanes)
    _positive_int("block", block)
    if isinstance(lag, bool) or not isinstance(lag, int) or lag < 0:
        raise ValueError(f"lag must be an int >= 0, not {lag!r}")
    items: Sequence[K] = list(identifiers)
    groups: list[list[K]] = []
    for start in range(0, len(items), lanes):
        group = list(items[start : start + lanes])
        own = group[rank % len(group)]
        # The others in key order (a claim key is a common prefix and the identifier, so
        # identifiers sort as their keys do), from just after this node's own unit.
        others = sorted(group, key=str)
        at = others.index(own)
        groups.append([own, *others[at + 1 :], *others[:at]])
    blocks = [groups[start : start + block] for start in range(0, len(groups), block)]
    order: list[K] = []
    for index in range(len(blocks) + lag):
        if index < len(blocks):
            order.extend([group[0] for group in blocks[index]])
        if index >= lag:
            for group in reversed(blocks[index - lag]):
                order.extend(group[1:])
    return order


# -- claim_index -------------------------------------------------------------------------------------

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


# -- order_runs --------------------------------------------------------------------------------------


class OrderRuns:
    """``order`` (sorted positions) cut into maximal runs of positions that go up or down by one.

    In a permutation two steps of +1 and -1 cannot follow each other (that would repeat a
    position), so a run is every stretch of steps of size one, and its direction is its first.

    Args:
        order: A permutation of ``range(len(order))`` (not checked here).
        starts: The index in ``order`` where each run starts, if the caller computed them (the
            simulator does, with numpy, for a thousand orders); None: computed here.

    Example:
        >>> runs = OrderRuns([3, 4, 5, 2, 1, 0])
        >>> list(runs.starts), runs.next_free(0, bytearray([0, 1, 0, 1, 1, 1]))
        ([0, 3], 3)
    """

    def __init__(self, order: Sequence[int], starts: Sequence[int] | None = None) -> None:
        self.order = order
        if starts is None:
            starts = array("i", [0] if len(order) else [])
            previous = None
            for index, position in enumerate(order):
                if index and (position - previous != 1 and previous - position != 1):
                    starts.append(index)
                previous = position
        self.starts = starts

    def __len__(self) -> int:
        return len(self.starts)

    def next_free(self, index: int, known: bytearray) -> int:
        """The first index from ``index`` on whose position ``known`` does not flag, or ``len(order)``."""
        order = self.order
        end = len(order)
        if index >= end:
            return end
        starts = self.starts
        run = bisect.bisect_right(starts, index) - 1
        last_run = len(starts) - 1
        while True:
            stop = starts[run + 1] if run < last_run else end  # the run is order[start:stop]
            position = order[index]
            if stop - index == 1:
                if not known[position]:
                    return index
            elif order[index + 1] > position:  # ascending: positions position .. position + left - 1
                found = known.find(0, position, position + stop - index)
                if found >= 0:
                    return index + found - position
            else:  # descending: position, position - 1, ...
                found = known.rfind(0, position - (stop - index) + 1, position + 1)
                if found >= 0:
                    return index + position - found
            if run == last_run:
                return end
            run += 1
            index = stop
