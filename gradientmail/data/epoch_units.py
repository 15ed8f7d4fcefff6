"""Several seeded passes over a set of work units as one run of the shared queue.

A run's claims are permanent, so a second pass over the same units needs other identifiers:
``epochs(units, n)`` makes one mapping of ``n`` passes whose identifiers carry the pass (and the
unit's place in it), so ``n`` epochs are one run under one prefix, each ``(epoch, unit)`` claimed
once, resumable anywhere. See docs/data.md.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from gradientmail.errors import InvalidKeyError, short_repr
from gradientmail.mailbox.keys import validate_key

__all__ = ["EpochUnit", "epochs", "permutation", "position_width"]

V = TypeVar("V")

EPOCH_DIGITS = 4
"""Digits of the epoch in an identifier (more when ``n`` needs them)."""


def position_width(count: int) -> int:
    """Digits of a position among ``count`` (at least 4), so positions sort as numbers do.

    Example:
        >>> position_width(24), position_width(123_456)
        (4, 6)
    """
    return max(4, len(str(max(count - 1, 0))))


def checked_int(name: str, value: object, *, low: int) -> int:
    """``value`` when it is an ``int`` (not a ``bool``) of at least ``low``; else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, not {value!r}")
    return value


def _stream(*parts: object) -> bytes:
    """The bytes that seed one stream: its parts, unambiguously joined."""
    return "\x1f".join(str(part) for part in parts).encode()


def permutation(n: int, *, seed: int, epoch: int = 0, key: str = "") -> list[int]:
    """A permutation of ``range(n)`` drawn from ``(seed, epoch, key)``: rows within a unit, shuffled.

    The same on every node and every Python (a Fisher-Yates shuffle over ``random.Random.random``,
    whose sequence for an integer seed Python keeps stable), different for each epoch and unit,
    so a loader reads a unit's rows in a new order each pass without agreeing on anything. An
    ``EpochUnit`` draws its own: ``item.permutation(n)``.

    Example:
        >>> permutation(5, seed=0) == permutation(5, seed=0), sorted(permutation(5, seed=0))
        (True, [0, 1, 2, 3, 4])
    """
    checked_int("n", n, low=0)
    checked_int("seed", seed, low=0)
    digest = hashlib.blake2b(_stream("rows", seed, epoch, key), digest_size=16).digest()
    draw = random.Random(int.from_bytes(digest, "big")).random
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        j = int(draw() * (i + 1))
        order[i], order[j] = order[j], order[i]
    return order


@dataclass(frozen=True)
class EpochUnit(Generic[V]):
    """One unit in one pass: what ``load`` receives from an ``epochs`` mapping."""

    epoch: int
    """The pass, from 0."""
    identifier: str
    """The unit's identifier in the mapping given to ``epochs``."""
    unit: V
    """The unit's value in that mapping."""
    seed: int
    """The run's seed, for ``permutation``."""

    def permutation(self, n: int) -> list[int]:
        """This pass's order of the unit's ``n`` rows: ``permutation(n, seed, epoch, identifier)``."""
        return permutation(n, seed=self.seed, epoch=self.epoch, key=self.identifier)


def pass_order(identifiers: list[str], *, seed: int, epoch: int) -> list[str]:
    """The identifiers sorted by a hash keyed with ``(seed, epoch)``: one pass's shuffled order.

    It depends on the set of identifiers only, not on the order they came in, so nodes that
    listed a bucket in different orders still agree.
    """
    base = hashlib.blake2b(_stream("pass", seed, epoch), digest_size=8)

    def rank(identifier: str) -> tuple[bytes, str]:
        hashed = base.copy()
        hashed.update(identifier.encode())
        return hashed.digest(), identifier

    return sorted(identifiers, key=rank)


def epochs(units: Mapping[str, V], n: int, *, seed: int = 0, shuffle: bool = True) -> dict[str, EpochUnit[V]]:
    """``n`` passes over ``units`` as one mapping for the shared queue: one run, one prefix.

    Pass ``e`` holds every unit once, as ``EpochUnit(e, identifier, value, seed)`` under
    ``f"e{e:04d}/{position:04d}-{identifier}"``: its place in the pass is part of its key, so
    the store's sorted keys follow the mapping's order and the queue's listings stay cheap (a
    shuffled order under plain keys costs about twice the requests per claim). The mapping
    holds pass 0 first, then pass 1, and so on; nodes claim in that order, so pass ``e + 1``
    starts as soon as pass ``e`` has no unclaimed unit left near the nodes' place, while its
    last units are still being trained: no node waits at an epoch's end.

    Args:
        units: The units of one pass (identifier -> the value ``load`` needs).
        n: Passes (epochs).
        seed: Chooses every pass's order. Keep it for the run: another seed makes other
            identifiers, and a restart with it is refused (``RunMismatchError``).
        shuffle: Each pass in its own order drawn from ``(seed, epoch)``, the same on every
            node whatever order ``units`` came in; ``False`` keeps ``units``' order in every pass.

    Raises:
        ValueError: ``n`` is not a positive int, ``seed`` not an int >= 0, or ``units`` is empty.
        InvalidKeyError: an identifier would not make a valid mailbox key.

    Example:
        >>> run = epochs({"a": 1, "b": 2, "c": 3}, 2, seed=2)
        >>> [(item.epoch, item.identifier) for item in run.values()]
        [(0, 'c'), (0, 'b'), (0, 'a'), (1, 'b'), (1, 'a'), (1, 'c')]
        >>> list(run)[:2]
        ['e0000/0000-c', 'e0000/0001-b']
    """
    checked_int("n", n, low=1)
    checked_int("seed", seed, low=0)
    identifiers = list(units)
    if not identifiers:
        raise ValueError("epochs() needs at least one unit")
    for identifier in identifiers:
        if not isinstance(identifier, str):
            raise InvalidKeyError(f"unit identifiers must be str, not {short_repr(identifier)}")
    epoch_width = max(EPOCH_DIGITS, len(str(n - 1)))
    width = position_width(len(identifiers))
    mapping: dict[str, EpochUnit[V]] = {}
    for epoch in range(n):
        order = pass_order(identifiers, seed=seed, epoch=epoch) if shuffle else identifiers
        for position, identifier in enumerate(order):
            key = f"e{epoch:0{epoch_width}d}/{position:0{width}d}-{identifier}"
            if epoch == 0:
                try:
                    validate_key(key)
                except InvalidKeyError as exc:
                    raise InvalidKeyError(f"unit {short_repr(identifier)}: {exc}") from None
            mapping[key] = EpochUnit(epoch, identifier, units[identifier], seed)
    return mapping
