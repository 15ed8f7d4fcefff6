"""How claimers competing for the same next units part ways.

Pure functions over one claimer's view: ``order`` (sorted positions in preference order),
``known`` (1 per position known claimed) and ``settled`` (the positions the latest listing
settled). Why each rule exists: docs/queue.md.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import NamedTuple

__all__ = [
    "CROWD_LIMIT",
    "CROWD_MEMORY",
    "free_run",
    "jump_target",
    "Settled",
    "SHARED_CROWD_LIMIT",
    "SPREAD",
    "spread",
    "STRETCH",
]


class Settled(NamedTuple):
    """The sorted positions ``first`` to ``last`` (inclusive) a listing showed as they are."""

    first: int
    last: int

    def __contains__(self, position: object) -> bool:
        return isinstance(position, int) and self.first <= position <= self.last


SPREAD = 64
"""After a lost create, take one of the next 16 free units (doubling per loss in a row, up to
``SPREAD``), not the first: claimers that lost together would otherwise lose together again."""

CROWD_LIMIT = 0.9
"""A claimer walks in a crowd when more than this share of its recent listings found its
candidate taken: it then jumps ahead (``STRETCH``)."""

SHARED_CROWD_LIMIT = 0.5
"""``CROWD_LIMIT`` where every node walks the same order (``SharedQueueDataset(order=None)``: the
mapping's): whoever is behind catches up with whoever is ahead and they race for the same next
units, so jumping apart pays sooner. Real races (threads or processes, not the virtual clock)
measured: 64 threads 0.61 -> 0.27 lost creates a claim, two node processes on one directory
about 1.0 -> 0.5 listings a claim. Not with rotation: there a listing that finds its candidate
taken is mostly a helper among helpers, and jumping away spread the steps (11 -> 39 at 64 nodes)."""

CROWD_MEMORY = 10
"""Roughly how many recent listings the crowd estimate remembers."""

STRETCH = 16
"""In a crowd, jump ``STRETCH`` units into the first run of ``2 * STRETCH`` free units ahead,
then create up to ``STRETCH`` units blindly per listing."""

JUMP_WINDOW = 4096
"""How far along its order (in units) a claimer looks for a free run to jump to."""


def free_run(order: Sequence[int], known: bytearray, settled: Settled, index: int, limit: int) -> int:
    """How many units from ``order[index]`` on (at most ``limit``) the latest listing shows free.

    Example:
        >>> free_run([0, 1, 2, 3], bytearray([0, 0, 1, 0]), Settled(0, 3), 0, 4)
        2
    """
    end = min(len(order), index + limit)
    first, last = settled
    for later in range(index, end):
        position = order[later]
        if known[position] or not first <= position <= last:
            return later - index
    return end - index


def jump_target(order: Sequence[int], known: bytearray, settled: Settled, index: int) -> int:
    """Where a crowded claimer goes from free candidate ``index``: ``STRETCH`` units into the
    first run of ``2 * STRETCH`` free units (``index`` if none is near), leaving the start of the
    run to whoever walks into it."""
    segment = order[index : index + JUMP_WINDOW]
    first, last = settled
    if first > 0 or last < len(known) - 1:  # only what the listing showed is known
        segment = segment[
            : next((i for i, position in enumerate(segment) if not first <= position <= last), len(segment))
        ]
    flags = bytes(map(known.__getitem__, segment))  # 1: known claimed
    found = flags.find(bytes(2 * STRETCH))
    return index if found < 0 else index + found + STRETCH


def spread(order: Sequence[int], known: bytearray, settled: Settled, index: int, losses: int, seat: int) -> int:
    """One of the first free candidates from ``index`` the latest listing settled, chosen by the
    claimer's ``seat`` and its ``losses`` in a row, so claimers that lost together part.

    Example:
        >>> spread([0, 1, 2, 3], bytearray(4), Settled(0, 3), 0, losses=1, seat=0) in range(4)
        True
    """
    width = min(SPREAD, 8 << losses)
    free = []
    first, last = settled
    for later in range(index, len(order)):
        position = order[later]
        if not first <= position <= last:
            break
        if not known[position]:
            free.append(later)
            if len(free) == width:
                break
        if later - index >= 4 * width:
            break  # a run of known claims: the scan stays short
    return free[zlib.crc32(losses.to_bytes(4, "little"), seat) % len(free)]
