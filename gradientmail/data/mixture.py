"""A weighted mixture of several sources' work units, in proportion at every point of the run.

``mix({"web": (web_units, 0.9), "code": (code_units, 0.1)})`` interleaves the sources so that
after any number of units each source has its share to within one unit: a node that stops
early, or a run cut short, has trained the mixture it asked for. See docs/data.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Generic, TypeVar

from gradientmail.data.epoch_units import checked_int, position_width
from gradientmail.errors import InvalidKeyError, short_repr
from gradientmail.mailbox.keys import validate_key

__all__ = ["SourceUnit", "apportion", "interleave", "mix"]

V = TypeVar("V")

WEIGHT_DENOMINATOR = 1_000_000
"""A float weight is read as the nearest fraction with at most this denominator (0.1 is 1/10)."""


@dataclass(frozen=True)
class SourceUnit(Generic[V]):
    """One unit of one source: what ``load`` receives from a ``mix`` mapping."""

    source: str
    """The source's name in ``mix``'s argument."""
    identifier: str
    """The unit's identifier in that source's mapping."""
    unit: V
    """The unit's value in that mapping."""


def apportion(size: int, weights: list[Fraction]) -> list[int]:
    """``size`` units shared by ``weights`` (summing to 1), largest remainders first (ties: first).

    Example:
        >>> apportion(10, [Fraction(2, 3), Fraction(1, 3)])
        [7, 3]
    """
    quotas = [size * weight for weight in weights]
    shares = [math.floor(quota) for quota in quotas]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - shares[i]), i))
    for i in by_remainder[: size - sum(shares)]:
        shares[i] += 1
    return shares


def interleave(shares: list[int]) -> list[int]:
    """An order of ``sum(shares)`` slots, ``shares[s]`` of them source ``s``'s, in proportion at every prefix.

    Tijdeman's rule for the chairman assignment problem: slot ``t`` goes, of the sources owed
    at least ``sigma`` of a unit by then, to the one whose next unit falls due first (the least
    ``(taken + 1 - sigma) / share``), with ``sigma = 1 / (2k - 2)`` for ``k`` sources (ties to
    the first source). After any ``t`` slots, source ``s`` holds
    ``t * shares[s] / sum(shares)`` of them to within ``1 - 1 / (2k - 2)``, so within one unit.

    Example:
        >>> interleave([3, 1])
        [0, 0, 1, 0]
    """
    total = sum(shares)
    active = [s for s, share in enumerate(shares) if share > 0]
    d = 2 * len(active) - 2 if len(active) > 1 else 1  # sigma = 1 / d (0 for one source)
    sigma = 1 if len(active) > 1 else 0
    taken = [0] * len(shares)
    order: list[int] = []
    for t in range(1, total + 1):
        # In integers: owed at least sigma by now, t * share / total - taken >= 1 / d; of those,
        # the least (taken + 1 - 1 / d) / share, compared by cross-multiplying.
        best = -1
        for s in active:
            if d * (t * shares[s] - taken[s] * total) < sigma * total:
                continue
            if best < 0 or (d * (taken[s] + 1) - sigma) * shares[best] < (d * (taken[best] + 1) - sigma) * shares[s]:
                best = s
        order.append(best)
        taken[best] += 1
    return order


def _weight(name: str, value: object) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, int | float | Fraction) or not math.isfinite(value):
        raise ValueError(f"source {name!r}: a weight is a finite number > 0, not {short_repr(value)}")
    if value <= 0:
        raise ValueError(f"source {name!r}: weight {value!r} is not > 0 (leave the source out instead)")
    return Fraction(value).limit_denominator(WEIGHT_DENOMINATOR)


def _source_name(name: object) -> str:
    if not isinstance(name, str) or not name or "/" in name:
        raise InvalidKeyError(f"a source name is a non-empty str without '/', not {short_repr(name)}")
    try:
        validate_key(name)
    except InvalidKeyError as exc:
        raise InvalidKeyError(f"source name {name!r} is not a valid key segment: {exc}") from None
    return name


def mix(sources: Mapping[str, tuple[Mapping[str, V], float]], *, size: int | None = None) -> dict[str, SourceUnit[V]]:
    """Several sources' units as one mapping for the shared queue, interleaved by weight.

    Each source gives ``(units, weight)``. The mixture holds ``size`` units, each source's share
    of them by weight (largest remainders), taken from the front of its mapping in its order;
    the order interleaves the sources so that after any number of units each one has its share
    to within one unit (``interleave``). A unit's key is ``f"{position:04d}-{source}/{identifier}"``:
    the store's sorted keys follow the mixture's order, which keeps the queue's listings cheap.
    The order is fixed by the weights alone: shuffle each source with ``epochs`` first (which
    also repeats a source that must supply more units than it has).

    Args:
        sources: Source name (one key segment) -> ``(units, weight)``; weights are relative.
        size: Units in the mixture. Default: the most that no source runs out of, so the
            source with the fewest units for its weight is used whole and the others in part.

    Raises:
        ValueError: no source, a source without units, a weight that is not a finite number
            > 0, or a ``size`` that would take more units from a source than it has.
        InvalidKeyError: a source name that is not one key segment, or an identifier that
            would not make a valid mailbox key.

    Example:
        >>> mixed = mix({"web": ({"w0": 0, "w1": 1, "w2": 2}, 3), "code": ({"c0": 0}, 1)})
        >>> list(mixed)
        ['0000-web/w0', '0001-web/w1', '0002-code/c0', '0003-web/w2']
    """
    if not sources:
        raise ValueError("mix() needs at least one source")
    names, unit_maps, weights = [], [], []
    for name, entry in sources.items():
        names.append(_source_name(name))
        if not isinstance(entry, tuple) or len(entry) != 2 or not isinstance(entry[0], Mapping):
            raise ValueError(f"source {name!r}: give (units, weight), a mapping and a number, not {short_repr(entry)}")
        units, weight = entry
        if not units:
            raise ValueError(f"source {name!r} has no units")
        unit_maps.append(units)
        weights.append(_weight(name, weight))
    total = sum(weights)
    weights = [weight / total for weight in weights]
    if size is None:
        # Every quota at most its source's length, so no share (a quota rounded up) exceeds it.
        size = min(math.floor(len(units) / weight) for units, weight in zip(unit_maps, weights))
        size = max(size, 1)
    checked_int("size", size, low=1)
    shares = apportion(size, weights)
    for name, units, share in zip(names, unit_maps, shares):
        if share > len(units):
            raise ValueError(
                f"source {name!r} has {len(units)} units and its weight asks for {share} of {size}: "
                f"repeat it (epochs(units, {math.ceil(share / len(units))})) or ask for a smaller size"
            )
    queues = [iter(units.items()) for units in unit_maps]
    width = position_width(size)
    mapping: dict[str, SourceUnit[V]] = {}
    for position, s in enumerate(interleave(shares)):
        identifier, value = next(queues[s])
        if not isinstance(identifier, str):
            raise InvalidKeyError(f"source {names[s]!r}: unit identifiers must be str, not {short_repr(identifier)}")
        key = f"{position:0{width}d}-{names[s]}/{identifier}"
        try:
            validate_key(key)
        except InvalidKeyError as exc:
            raise InvalidKeyError(f"source {names[s]!r}, unit {short_repr(identifier)}: {exc}") from None
        mapping[key] = SourceUnit(names[s], identifier, value)
    return mapping
