"""Work units for the shared queue: the seed's grid of (step group, lane) units, and orders.

A unit's *identifier* is what nodes agree on in the mailbox; its *value* is whatever the local
loader needs (here a ``Unit``). The queue never interprets values.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

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
    """The seed's grid: every group of ``unit_steps`` steps split into ``lanes`` units.

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


def rotated_order(identifiers: Iterable[K], rank: int, lanes: int) -> list[K]:
    """Identifiers with each consecutive group of ``lanes`` rotated left by ``rank``.

    With ``unit_grid``'s group-major order this makes node ``rank`` prefer lane
    ``rank % lanes`` first in every group of steps, then the following lanes, so nodes that
    start together rarely compete for one unit while still sharing every identifier. Pass the
    result as ``order=`` (a mapping works as ``identifiers``: its keys are used)::

        >>> rotated_order(["a0", "a1", "a2", "b0", "b1", "b2"], rank=1, lanes=3)
        ['a1', 'a2', 'a0', 'b1', 'b2', 'b0']

    A shorter last group is rotated by ``rank`` modulo its own length.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be an int >= 0, not {rank!r}")
    _positive_int("lanes", lanes)
    items: Sequence[K] = list(identifiers)
    order: list[K] = []
    for start in range(0, len(items), lanes):
        group = list(items[start : start + lanes])
        shift = rank % len(group)
        order.extend(group[shift:] + group[:shift])
    return order
