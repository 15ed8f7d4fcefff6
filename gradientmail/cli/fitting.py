"""Fitting a table into a terminal's width: names cut in the middle yet distinct, counts compact.

Learner ids default to ``{hostname}-{rank}``, so the names in one table share long prefixes and
differ at the end: cutting them at the right edge (``machine…``) makes them identical. Here a
name loses its middle (``machi…hostname-3``), keeping its distinguishing end, and only when
every shortened name still differs from every other.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

ELLIPSIS = "…"


def shorten_middle(name: str, width: int, head: int) -> str:
    """``name`` in at most ``width`` characters: its first ``head``, ``…``, then its end.

    Example:
        >>> shorten_middle("machine-with-a-long-hostname-3", 16, 5)
        'machi…hostname-3'
        >>> shorten_middle("node-A", 16, 5)
        'node-A'
    """
    if len(name) <= width:
        return name
    tail = width - 1 - head
    return name[:head] + ELLIPSIS + (name[-tail:] if tail > 0 else "")


def short_names(names: Iterable[str], width: int) -> dict[str, str]:
    """Each name in at most ``width`` characters, shortened from the middle, all still distinct.

    Tries a head of about a third of ``width`` first (a recognisable start), then shorter ones
    down to none (more of the end, where ``{hostname}-{rank}`` names differ), then longer ones.
    When no split keeps every name distinct, every name is returned whole (the caller wraps).

    Example:
        >>> short_names([f"machine-with-a-long-hostname-{rank}" for rank in range(2)], 12)
        {'machine-with-a-long-hostname-0': 'mach…tname-0', 'machine-with-a-long-hostname-1': 'mach…tname-1'}
        >>> short_names(["node-1-a", "node-2-a"], 3)  # nothing that short differs: kept whole
        {'node-1-a': 'node-1-a', 'node-2-a': 'node-2-a'}
    """
    names = list(dict.fromkeys(names))
    whole = {name: name for name in names}
    if width < 2 or all(len(name) <= width for name in names):
        return whole
    first = width // 3
    for head in [*range(first, -1, -1), *range(first + 1, width - 1)]:
        shown = {name: shorten_middle(name, width, head) for name in names}
        if len(set(shown.values())) == len(names):
            return shown
    return whole


def compact_count(value: float | None, digits: int = 0) -> str:
    """A count in at most about six characters: ``6,144`` stays, ``1,536,000`` is ``1.54M``.

    Example:
        >>> [compact_count(v) for v in (None, 42, 6144, 61_440, 999_999, 1_536_000, 2.5e9)]
        ['-', '42', '6,144', '61.4k', '1M', '1.54M', '2.5G']
        >>> compact_count(128.04, 1)
        '128.0'
    """
    if value is None or not math.isfinite(value):
        return "-"
    if abs(value) < 10_000:
        return f"{value:,.{digits}f}"
    for scale, suffix in ((1e3, "k"), (1e6, "M"), (1e9, "G")):
        text = f"{value / scale:.3g}"
        if abs(float(text)) < 1000:  # 999,999 rounds to 1e+03k: one suffix up
            return text + suffix
    return f"{value / 1e12:,.3g}T"
