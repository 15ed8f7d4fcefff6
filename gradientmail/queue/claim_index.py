"""The claim keys of a set of units in the store's sorted order, shared by their claimers.

A ``Claimer`` works on sorted positions, not identifiers: a listing comes back in key order,
and a position is 4 bytes where an identifier is tens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from gradientmail.layout import CLAIMS_PREFIX, claim_key

__all__ = ["ClaimIndex", "PositionOrder"]


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
        self.keys: list[str] = [key for key, _ in named]
        self.positions: dict[str, int] = {key: position for position, key in enumerate(self.keys)}
        self._by_identifier = {identifier: position for position, (_, identifier) in enumerate(named)}
        if len(self.positions) != len(self.keys):
            raise ValueError("unit identifiers must be unique")

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


class PositionOrder(Sequence[str]):
    """A preference order held as sorted positions in a ``ClaimIndex``: identifiers on demand.

    A list of a million identifiers costs each node tens of MB and a lookup per unit to turn
    into positions; an ``array("i")`` of positions costs 4 bytes a unit. ``positions`` must be
    a permutation of ``range(len(index))`` (not checked: the caller built it from the index).
    """

    def __init__(self, index: ClaimIndex, positions: Sequence[int]) -> None:
        if len(positions) != len(index):
            raise ValueError(f"{len(positions)} positions for an index of {len(index)} units")
        self.index = index
        self.positions = positions

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, item: Any) -> Any:
        keys = self.index.keys
        if isinstance(item, slice):
            return [keys[position][len(CLAIMS_PREFIX) :] for position in self.positions[item]]
        return keys[self.positions[item]][len(CLAIMS_PREFIX) :]
