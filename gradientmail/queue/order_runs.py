"""A preference order as runs of consecutive sorted positions: skipping known claims in bulk.

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
from array import array
from collections.abc import Sequence

__all__ = [
    "OrderRuns",
]


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
