"""A bounded LRU cache of fixed-size blocks of one file, so a reader's memory stays bounded.

Missing consecutive blocks are fetched in one ranged request; see docs/data.md ("Workers,
caching and cost").
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheStats:
    """Counters of one process's cache: ``reads`` ranged requests fetched ``bytes_read`` bytes.

    ``hits``, ``misses``, ``held_bytes`` and ``capacity`` are of the memory cache. With a
    ``cache_dir``, the memory cache's misses are looked up there: ``disk_hits`` and ``disk_misses``
    count blocks, ``disk_held_bytes`` is the directory's count (every process and file sharing it)
    and ``disk_capacity`` its bound; all four are 0 without one.
    """

    hits: int
    misses: int
    reads: int
    bytes_read: int
    held_bytes: int
    capacity: int
    disk_hits: int = 0
    disk_misses: int = 0
    disk_held_bytes: int = 0
    disk_capacity: int = 0


class BlockCache:
    """Blocks ``[k * block_size, (k + 1) * block_size)`` of a file, at most ``capacity`` bytes held.

    A request larger than the cache is still served, from blocks that are not all kept.

    Args:
        fetch: ``fetch(start, stop)`` reads bytes ``[start, stop)`` of the file.
        size: the file's size in bytes.
        block_size: bytes per block (a positive int).
        capacity: bytes of blocks kept; below ``block_size`` (e.g. ``0``) nothing is kept and
            each read fetches just its range.

    Raises:
        ValueError: ``block_size`` or ``capacity`` is not a valid number of bytes.
    """

    def __init__(self, fetch: Callable[[int, int], bytes], size: int, block_size: int, capacity: int) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive number of bytes, not {block_size!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"cache_bytes must be a number of bytes >= 0, not {capacity!r}")
        self._fetch = fetch
        self.size = size
        self.block_size = block_size
        self.capacity = capacity
        self._blocks: OrderedDict[int, bytes] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()
        self._hits = self._misses = self._reads = self._bytes_read = 0
        _LIVE.add(self)

    def after_fork(self) -> None:
        """A forked child (a DataLoader worker) starts with a fresh lock: another thread of the
        parent may have held this one at the moment of the fork, and would never release it."""
        self._lock = threading.Lock()

    def stats(self) -> CacheStats:
        return CacheStats(self._hits, self._misses, self._reads, self._bytes_read, self._held, self.capacity)

    def read(self, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` of the file (``0 <= start <= stop <= size``)."""
        if start >= stop:
            return b""
        if self.capacity < self.block_size:  # no block could be kept: read just what is asked
            data = self._fetch(start, stop)
            with self._lock:
                self._misses += 1
                self._reads += 1
                self._bytes_read += len(data)
            return data
        size = self.block_size
        first, last = start // size, (stop - 1) // size
        with self._lock:  # one reader at a time: blocks are fetched once, counters stay exact
            found: dict[int, bytes] = {}
            missing: list[int] = []
            for index in range(first, last + 1):
                block = self._blocks.get(index)
                if block is None:
                    missing.append(index)
                else:
                    self._blocks.move_to_end(index)
                    found[index] = block
            self._hits += len(found)
            self._misses += len(missing)
            for run_first, run_last in consecutive_runs(missing):
                data = self._fetch(run_first * size, min((run_last + 1) * size, self.size))
                self._reads += 1
                self._bytes_read += len(data)
                for index in range(run_first, run_last + 1):
                    block = data[(index - run_first) * size : (index - run_first + 1) * size]
                    found[index] = block
                    self._keep(index, block)
            joined = b"".join(found[index] for index in range(first, last + 1))
        return joined[start - first * size : stop - first * size]

    def _keep(self, index: int, block: bytes) -> None:
        if len(block) > self.capacity:
            return
        self._blocks[index] = block
        self._held += len(block)
        while self._held > self.capacity:
            _, evicted = self._blocks.popitem(last=False)
            self._held -= len(evicted)

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._held = 0


def consecutive_runs(indices: list[int]) -> list[tuple[int, int]]:
    """Sorted block indices grouped into runs of consecutive ones, ``(first, last)`` each."""
    runs: list[tuple[int, int]] = []
    for index in indices:
        if runs and runs[-1][1] == index - 1:
            runs[-1] = (runs[-1][0], index)
        else:
            runs.append((index, index))
    return runs


_LIVE: weakref.WeakSet[BlockCache] = weakref.WeakSet()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: [cache.after_fork() for cache in list(_LIVE)])
