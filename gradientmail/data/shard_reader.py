"""What every shard reader shares: the shard opened through the cache, its batches as queue pairs.

A ``Shard``'s pin is checked when it is opened, and ``reader(shard)`` yields ``(index, batch)``
pairs, so a reader is a ``load`` for ``shared_queue`` as it is, also over units that wrap a
shard in ``.unit`` (those of ``epochs()`` and ``mix()``), whose ``permutation`` shuffles rows.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from gradientmail.data.errors import ShardError
from gradientmail.data.shard_cache import CachedFile, ShardCache
from gradientmail.data.shard_units import Shard

ShardLike = Shard | str | os.PathLike[str]
"""A ``Shard`` from ``shards()`` (its pin checked, its part read), or a whole file's path or URL."""

Permutation = Callable[[int], list[int]]
"""``permutation(n)``: the order in which to read a unit's ``n`` rows (an ``EpochUnit``'s method)."""


def unwrap(value: Any) -> tuple[ShardLike, Permutation | None]:
    """The shard a unit value holds, and the row order it draws, if any.

    A ``Shard``, path or URL is itself; any other value is followed through its ``unit`` attribute
    (``EpochUnit`` of ``epochs()``, ``SourceUnit`` of ``mix()``, nested), and the outermost
    ``permutation`` method met on the way is the row order (an epoch's, new each pass).

    Raises:
        TypeError: the value holds no shard.
    """
    permutation = None
    inner = value
    while not isinstance(inner, (Shard, str, os.PathLike)):
        method = getattr(inner, "permutation", None)
        if permutation is None and callable(method):
            permutation = method
        if not hasattr(inner, "unit"):
            raise TypeError(
                f"a shard reader reads a Shard (from shards()), a path or URL, or a unit wrapping one in "
                f".unit (epochs(), mix()), not {type(value).__name__} {value!r:.200}"
            )
        inner = inner.unit
    return inner, permutation


class ShardReader(ABC):
    """Turns one shard into batches: ``reader(shard)`` is a ``load`` for ``shared_queue``.

    Readers hold only their settings, so they pickle into DataLoader workers; each call opens the
    shard afresh (through ``cache``, shared by the machine's processes when it has a directory).

    Args:
        cache: where blocks of remote files are kept (``ShardCache(directory)``); None keeps a
            bounded memory cache per read.
        storage_options: passed to fsspec (``{"endpoint_url": ...}`` for s3fs).
        shuffle: read each unit's rows in the order its value draws (``EpochUnit.permutation``
            of ``epochs()``: the same on every node, another each pass). The unit's rows are then
            held in memory at once: size units accordingly (``split=``).
    """

    def __init__(
        self,
        *,
        cache: ShardCache | None = None,
        storage_options: Mapping[str, Any] | None = None,
        shuffle: bool = False,
    ) -> None:
        self.cache = cache if cache is not None else ShardCache()
        self.storage_options = dict(storage_options or {})
        self.shuffle = bool(shuffle)

    def __call__(self, value: Any) -> Iterator[tuple[int, Any]]:
        """``(index, batch)`` pairs of the shard ``value`` holds, ``index`` counting the unit's
        batches from 0 (a step label the queue records to resume a unit mid-way; count global
        steps in your loop).

        Raises:
            ShardError: ``shuffle=True`` but the value draws no row order (not from ``epochs()``).
            TypeError: the value holds no shard.
        """
        shard, permutation = unwrap(value)
        if self.shuffle and permutation is None:
            raise ShardError(
                f"shuffle=True reads a unit's rows in the order its epoch draws, but {value!r:.200} has no "
                "permutation(n): give the reader units of epochs(...)"
            )
        yield from enumerate(self.batches(shard, permutation if self.shuffle else None))

    @abstractmethod
    def batches(self, shard: ShardLike, permutation: Permutation | None = None) -> Iterator[Any]:
        """The shard's batches, in the same order on every call (a resumed unit skips by position);
        with a ``permutation``, its rows in the order ``permutation(rows)`` gives."""

    def open(self, shard: ShardLike) -> CachedFile:
        """The shard's file through the cache; a ``Shard``'s size and version are checked.

        Raises:
            FileChangedError: the file was replaced since ``shards()`` listed it.
            FileNotFoundError: it is gone.
        """
        if isinstance(shard, Shard):
            return self.cache.open(shard.url, self.storage_options or None, pin=shard.pin)
        return self.cache.open(shard, self.storage_options or None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cache={self.cache!r})"
