"""A bounded directory of a remote file's blocks on local disk, shared by one machine's processes.

A second pass, another DataLoader worker or a restarted node reads a block from disk instead of
downloading it again. See docs/data.md ("A disk cache for remote files").

The directory is flat, and only these names are ever created, counted or removed:

- ``<object>.<version>.<block_size>.<index>.blk``: one block and the CRC-32 of it (4 bytes,
  little-endian). ``<object>`` hashes the URL and endpoint, ``<version>`` the version pinned when
  the reader opened the object (ETag, generation...) and its size: a rewritten object gets new
  names, so an old block is never served for it, and its old blocks are removed by the next scan.
- ``.tmp-*``: a block being written, renamed into place (``os.replace``) once whole; readers never
  see part of a file. One left by a killed process is removed after an hour.
- ``.ledger``: 8 bytes, the bytes of the files above as counted by the writers, read and written
  under ``flock``; never below what is on disk (a writer counts its file before writing it).

No lock guards the data: blocks are immutable once renamed, a file that vanishes (evicted by
another process) is a miss, and a file of the wrong length or checksum is a miss that is fetched
and replaced. The lock only keeps the count exact, so that the bound holds across processes.
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
import threading
import time
import warnings
import weakref
import zlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from gradientmail.data.cache import CacheStats, consecutive_runs

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no lock, so the bound is approximate
    fcntl = None  # type: ignore[assignment]

BLOCK_SUFFIX = ".blk"
TEMP_PREFIX = ".tmp-"
LEDGER_NAME = ".ledger"
CHECKSUM = struct.Struct("<I")
STALE_TEMP_SECONDS = 3600.0
"""A temporary file this old was left by a killed process (a live one renames it in moments)."""
LOW_WATER = 0.9
"""An eviction frees down to this share of the bound: one directory scan per tenth written."""


def remote_identity(url: str, storage_options: Mapping[str, Any]) -> str:
    """The URL and the endpoint it is read from: the same ``s3://`` path on two stores is two objects.

    The endpoint is ``storage_options``'s, else (for ``s3://``) ``AWS_ENDPOINT_URL_S3`` or
    ``AWS_ENDPOINT_URL``, as botocore reads them. Credentials are left out, so that rotated keys
    keep the cache.

    Example:
        >>> remote_identity("s3://b/train.bin", {"endpoint_url": "http://127.0.0.1:9000", "key": "k"})
        's3://b/train.bin @ http://127.0.0.1:9000'
    """
    client = storage_options.get("client_kwargs") or {}
    endpoint = storage_options.get("endpoint_url") or client.get("endpoint_url")
    if not endpoint and url.startswith(("s3://", "s3a://")):  # botocore reads these when not told
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return f"{url} @ {endpoint}" if endpoint else url


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class DiskCache:
    """Blocks of one version of one remote file, kept as files in ``directory`` (at most ``capacity``
    bytes in all, for every object cached there, least recently used evicted first).

    Args:
        fetch: ``fetch(start, stop)`` reads bytes ``[start, stop)`` from the store.
        directory: the cache directory (created if missing); several processes may share it.
        identity: what names the object (``remote_identity``).
        version: the object's version pinned when it was opened.
        size, block_size: the file's size and the bytes per block (as the memory cache's).
        capacity: bytes of files the directory may hold, checksums included.

    ``reconcile()`` (once, when a reader opens the object) counts the directory and removes other
    versions' blocks; a pickled copy (a DataLoader worker) does not repeat it.

    Raises:
        ValueError: ``capacity`` cannot hold one block.
    """

    def __init__(
        self,
        fetch: Callable[[int, int], bytes],
        directory: str | os.PathLike[str],
        *,
        identity: str,
        version: str,
        size: int,
        block_size: int,
        capacity: int,
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive number of bytes, not {block_size!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < block_size + CHECKSUM.size:
            raise ValueError(
                f"cache_dir_bytes must hold at least one block ({block_size + CHECKSUM.size:,} bytes "
                f"with its checksum), not {capacity!r}"
            )
        self._fetch = fetch
        self.directory = os.fspath(directory)
        self.identity, self.version = identity, version
        self.size, self.block_size, self.capacity = size, block_size, capacity
        self._object = _digest(identity) + "."
        self._prefix = f"{self._object}{_digest(f'{version} {size}')}.{block_size}."
        self._lock = threading.Lock()  # the counters
        self._ledger_lock = threading.Lock()  # flock does not exclude threads sharing a descriptor
        _LIVE.add(self)
        self._ledger: int | None = None
        self._pid = -1
        self._warned = False
        self.hits = self.misses = self.reads = self.bytes_read = 0

    def after_fork(self) -> None:
        """A forked child (a DataLoader worker) starts with fresh locks: another thread of the
        parent may have held them at the moment of the fork."""
        self._lock = threading.Lock()
        self._ledger_lock = threading.Lock()

    def __reduce__(self) -> tuple[Any, ...]:
        """Rebuilt from its arguments: the ledger is reopened and counters start at 0 in a worker."""
        options = {"identity": self.identity, "version": self.version, "size": self.size}
        options.update(block_size=self.block_size, capacity=self.capacity)
        return (_rebuild, (self._fetch, self.directory, options))

    # -- reading ----------------------------------------------------------------------------
    def read(self, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)``: whole blocks from disk, the missing ones fetched and stored."""
        if start >= stop:
            return b""
        size = self.block_size
        first, last = start // size, (stop - 1) // size
        found = {index: self._load(index) for index in range(first, last + 1)}
        missing = [index for index, block in found.items() if block is None]
        with self._lock:
            self.hits += len(found) - len(missing)
            self.misses += len(missing)
        for run_first, run_last in consecutive_runs(missing):
            data = self._fetch(run_first * size, min((run_last + 1) * size, self.size))
            with self._lock:
                self.reads += 1
                self.bytes_read += len(data)
            for index in range(run_first, run_last + 1):
                block = data[(index - run_first) * size : (index - run_first + 1) * size]
                found[index] = block
                self._store(index, block)
        joined = b"".join(found[index] or b"" for index in range(first, last + 1))
        return joined[start - first * size : stop - first * size]

    def stats(self, memory: CacheStats) -> CacheStats:
        """``memory``'s counters, with the store's ranged reads and this directory's counters."""
        with self._lock:
            return replace(
                memory,
                reads=self.reads,
                bytes_read=self.bytes_read,
                disk_hits=self.hits,
                disk_misses=self.misses,
                disk_held_bytes=self.held_bytes(),
                disk_capacity=self.capacity,
            )

    def held_bytes(self) -> int:
        """The ledger's count of the directory's blocks (an upper bound; 0 before any)."""
        with self._locked() as ledger:
            return self._count(ledger) or 0

    def _path(self, index: int) -> str:
        return os.path.join(self.directory, f"{self._prefix}{index}{BLOCK_SUFFIX}")

    def _load(self, index: int) -> bytes | None:
        """Block ``index`` from disk, or None: absent, vanished, or not whole and intact."""
        path = self._path(index)
        length = min(self.block_size, self.size - index * self.block_size)
        try:
            with open(path, "rb") as stream:
                data = stream.read(length + CHECKSUM.size + 1)
        except OSError:  # FileNotFoundError: never stored, or evicted by another process meanwhile
            return None
        block, trailer = data[:length], data[length:]
        if len(trailer) != CHECKSUM.size or CHECKSUM.unpack(trailer)[0] != zlib.crc32(block):
            return None  # truncated or damaged: fetched again and replaced whole
        try:
            os.utime(path)  # most recently used: evicted last
        except OSError:
            pass  # evicted since it was read: the bytes read are still whole
        return block

    # -- writing ----------------------------------------------------------------------------
    def _store(self, index: int, block: bytes) -> None:
        """Write block ``index`` whole or not at all; a full or unwritable disk only warns."""
        content = block + CHECKSUM.pack(zlib.crc32(block))
        temp = None
        try:
            handle, temp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=self.directory)
            with os.fdopen(handle, "wb") as stream:
                stream.truncate(len(content))  # its whole size is counted by any scan from now on
                if not self._reserve(len(content)):
                    return
                stream.write(content)
            os.replace(temp, self._path(index))
            temp = None
        except OSError as exc:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"cache_dir {self.directory}: cannot store a block ({exc}); reading on from the store",
                    RuntimeWarning,
                    stacklevel=4,
                )
        finally:
            if temp is not None:
                _remove(temp)

    def _reserve(self, nbytes: int) -> bool:
        """Count ``nbytes`` more (a temporary file that size exists), evicting if the bound would be
        passed; False when even then it does not fit (files of other writers in flight)."""
        with self._locked() as ledger:
            total = self._count(ledger)
            if total is not None and total + nbytes <= self.capacity:
                self._set_count(ledger, total + nbytes)
                return True
            total = self._sweep(int(self.capacity * LOW_WATER))  # the temporary file included
            fits = total <= self.capacity
            self._set_count(ledger, total if fits else total - nbytes)
            return fits

    def reconcile(self) -> int:
        """Count the directory, remove other versions of this object and what passes the bound.

        Returns:
            The bytes the directory's blocks hold now.
        """
        os.makedirs(self.directory, exist_ok=True)
        with self._locked() as ledger:
            total = self._sweep(self.capacity)
            self._set_count(ledger, total)
            return total

    def _sweep(self, target: int) -> int:
        """Scan the directory and remove abandoned temporary files, blocks of this object's other
        versions, then the least recently used blocks until at most ``target`` bytes remain.

        Another process may remove files meanwhile (without ``flock``): those are skipped.
        """
        now = time.time()
        total, blocks = 0, []
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return 0
        for entry in entries:
            block = entry.name.endswith(BLOCK_SUFFIX) and not entry.name.startswith(".")
            if not (block or entry.name.startswith(TEMP_PREFIX)):
                continue  # not ours: never counted or touched
            try:
                info = entry.stat()
            except FileNotFoundError:
                continue
            stale = not block and now - info.st_mtime > STALE_TEMP_SECONDS
            if stale or (block and entry.name.startswith(self._object) and not entry.name.startswith(self._prefix)):
                _remove(entry.path)
                continue
            total += info.st_size
            if block:
                blocks.append((info.st_mtime_ns, info.st_size, entry.path))
        blocks.sort()
        for _, size, path in blocks:
            if total <= target:
                break
            _remove(path)
            total -= size
        return total

    # -- the ledger ---------------------------------------------------------------------------
    @contextmanager
    def _locked(self) -> Iterator[int]:
        """The ledger's descriptor, held under an exclusive ``flock`` (released if the process dies)."""
        with self._ledger_lock, self._flocked() as ledger:
            yield ledger

    @contextmanager
    def _flocked(self) -> Iterator[int]:
        if self._ledger is None or self._pid != os.getpid():  # a forked child locks its own descriptor
            os.makedirs(self.directory, exist_ok=True)
            self._ledger = os.open(os.path.join(self.directory, LEDGER_NAME), os.O_RDWR | os.O_CREAT, 0o644)
            self._pid = os.getpid()
        if fcntl is not None:
            fcntl.flock(self._ledger, fcntl.LOCK_EX)
        try:
            yield self._ledger
        finally:
            if fcntl is not None:
                fcntl.flock(self._ledger, fcntl.LOCK_UN)

    @staticmethod
    def _count(ledger: int) -> int | None:
        os.lseek(ledger, 0, os.SEEK_SET)
        data = os.read(ledger, 8)
        return struct.unpack("<Q", data)[0] if len(data) == 8 else None

    @staticmethod
    def _set_count(ledger: int, total: int) -> None:
        os.lseek(ledger, 0, os.SEEK_SET)
        os.write(ledger, struct.pack("<Q", max(total, 0)))

    def close(self) -> None:
        ledger, self._ledger = self._ledger, None
        if ledger is not None and self._pid == os.getpid():
            os.close(ledger)

    def __del__(self) -> None:
        if getattr(self, "_ledger", None) is not None:
            self.close()


def _rebuild(fetch: Callable[[int, int], bytes], directory: str, options: dict[str, Any]) -> DiskCache:
    return DiskCache(fetch, directory, **options)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass  # removed by another process already


_LIVE: weakref.WeakSet[DiskCache] = weakref.WeakSet()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: [cache.after_fork() for cache in list(_LIVE)])
