"""Work units for the shared queue: the design note's grid of (step group, lane) units, and orders.

A unit's *identifier* is what nodes agree on in the mailbox; its *value* is whatever the local
loader needs (here a ``Unit``). The queue never interprets values.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

__all__ = [
    "DEFAULT_BLOCK",
    "DEFAULT_LAG",
    "rotated_order",
    "Unit",
    "unit_grid",
]


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
