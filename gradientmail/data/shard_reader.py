"""What every shard reader shares: the shard opened through the cache, its batches as queue pairs.

A ``Shard``'s pin is checked when it is opened, and ``reader(shard)`` yields ``(index, batch)``
pairs, so a reader is a ``load`` for ``shared_queue`` as it is.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from typing import Any

from gradientmail.data.shard_cache import CachedFile, ShardCache
from gradientmail.data.shard_units import Shard

ShardLike = Shard | str | os.PathLike[str]
"""A ``Shard`` from ``shards()`` (its pin checked, its part read), or a whole file's path or URL."""


class ShardReader(ABC):
    """Turns one shard into batches: ``reader(shard)`` is a ``load`` for ``shared_queue``.

    Readers hold only their settings, so they pickle into DataLoader workers; each call opens the
    shard afresh (through ``cache``, shared by the machine's processes when it has a directory).

    Args:
        cache: where blocks of remote files are kept (``ShardCache(directory)``); None keeps a
            bounded memory cache per read.
        storage_options: passed to fsspec (``{"endpoint_url": ...}`` for s3fs).
    """

    def __init__(self, *, cache: ShardCache | None = None, storage_options: Mapping[str, Any] | None = None) -> None:
        self.cache = cache if cache is not None else ShardCache()
        self.storage_options = dict(storage_options or {})

    def __call__(self, shard: ShardLike) -> Iterator[tuple[int, Any]]:
        """``(index, batch)`` pairs, ``index`` counting the unit's batches from 0 (a step label
        the queue records to resume a unit mid-way; count global steps in your loop)."""
        yield from enumerate(self.batches(shard))

    @abstractmethod
    def batches(self, shard: ShardLike) -> Iterator[Any]:
        """The shard's batches, in the same order on every call (a resumed unit skips by position)."""

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
