"""A file read through the caches: a bounded memory cache and, for a remote file, a shared disk cache.

Every reader of ``gradientmail.data`` (token files, Parquet, JSON Lines, tar) reads its file through
one ``CachedFile``, configured by a ``ShardCache``: a second pass, another DataLoader worker or a
restarted node reads a remote shard's blocks from local disk instead of the store. See docs/data.md
("A disk cache for remote files").
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from gradientmail.data.cache import BlockCache, CacheStats
from gradientmail.data.disk_cache import DiskCache, remote_identity
from gradientmail.data.errors import FileChangedError
from gradientmail.data.sources import ByteSource, FsspecFile, LocalFile, open_source

DEFAULT_BLOCK_SIZE = 1 << 20
"""1 MiB: a few ranged requests per batch on S3, and finer than one lane's share of a step."""

DEFAULT_CACHE_BYTES = 64 << 20
"""Per process: each DataLoader worker holds a cache of its own."""

DEFAULT_CACHE_DIR_BYTES = 16 << 30
"""A ``cache_dir``'s bound, for every process and file sharing it: a few datasets of a few GB."""


class Pin(NamedTuple):
    """What a file must still be when it is read: its size and version (ETag, generation, mtime)."""

    size: int
    version: str | None


def local_version(path: str) -> str:
    """A local file's version as ``shards()`` pins it (fsspec's ``info()`` names it ``mtime``)."""
    return f"mtime={os.stat(path).st_mtime}"


@dataclass(frozen=True)
class ShardCache:
    """How much of the files read to keep, and where: the ``cache=`` of every reader.

    Args:
        directory: a local directory for remote files' blocks, shared by every process of the
            machine (DataLoader workers, torchrun's ranks, a restarted node); None keeps blocks in
            memory only. Local files are never copied (the OS's page cache holds them already).
        max_bytes: the directory's bound, for every process and file sharing it (least recently
            used blocks are evicted first).
        block_size: bytes per block, the unit of every ranged request, memory and disk entry.
        memory_bytes: blocks kept in memory, per process.

    Example:
        >>> from gradientmail.data import ShardCache
        >>> ShardCache("/tmp/gm-cache", max_bytes=1 << 30).block_size
        1048576
    """

    directory: str | None = None
    max_bytes: int = DEFAULT_CACHE_DIR_BYTES
    block_size: int = DEFAULT_BLOCK_SIZE
    memory_bytes: int = DEFAULT_CACHE_BYTES

    def open(
        self, url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None, pin: Pin | None = None
    ) -> CachedFile:
        """``url`` read through this cache; ``pin`` (a shard's) is checked first.

        Raises:
            FileChangedError: the file is not the pinned one.
            FileNotFoundError: there is no file at ``url``.
        """
        return CachedFile(
            url,
            storage_options=storage_options,
            block_size=self.block_size,
            cache_bytes=self.memory_bytes,
            cache_dir=self.directory,
            cache_dir_bytes=self.max_bytes,
            pin=pin,
        )


class CachedFile:
    """The bytes of one file, local or at any fsspec URL, through a memory and a disk cache.

    The file's size and version are pinned when it is opened; a remote object overwritten later
    raises ``FileChangedError`` on the next block fetched from the store (blocks of the pinned
    version already cached stay readable), and a pickled copy (a DataLoader worker) checks the
    file again on first use, with an empty memory cache of its own.

    Args:
        url: a local path, ``file://`` URL or any fsspec URL.
        storage_options: passed to fsspec (``{"endpoint_url": ...}`` for s3fs).
        block_size, cache_bytes: reads are whole blocks; at most ``cache_bytes`` are kept in memory.
        cache_dir, cache_dir_bytes: a remote file's blocks are also kept there (see ``ShardCache``).
        pin: the size and version the file must have (a ``Shard``'s), or None to take it as it is.

    Raises:
        FileChangedError: the file differs from ``pin``.
        FileNotFoundError: there is no file at ``url``.
        ValueError: ``cache_dir_bytes`` cannot hold one block, or a bad block size.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_dir_bytes: int = DEFAULT_CACHE_DIR_BYTES,
        pin: Pin | None = None,
    ) -> None:
        self.source: ByteSource = open_source(url, storage_options)
        self.url = self.source.name
        self.size = self.source.size()
        self.pin = pin
        if pin is not None:
            self._check_pin()
        self._disk = self._disk_cache(cache_dir, cache_dir_bytes, block_size)
        self._memory = BlockCache(self._fetch_function(), self.size, block_size, cache_bytes)
        self._pid = os.getpid()

    @property
    def local_path(self) -> str | None:
        """The path of a local file (readers open it directly: nothing to cache), else None."""
        return self.source.name if isinstance(self.source, LocalFile) else None

    def _fetch_function(self) -> Any:
        return self.source.read if self._disk is None else self._disk.read

    def _check_pin(self) -> None:
        assert self.pin is not None
        if isinstance(self.source, FsspecFile):
            version = self.source.pinned
        else:
            version = local_version(self.url) if self.pin.version is not None else None
        if (self.size, version) != tuple(self.pin):
            raise FileChangedError(
                f"{self.url} was replaced since it was listed: {self.pin.size:,} bytes, version "
                f"{self.pin.version!r} then; {self.size:,} bytes, version {version!r} now. Reading it would "
                "train on other data than the run listed: list the shards again, for a new run "
                "(and write new files rather than overwrite those of a running run)"
            )

    def _disk_cache(self, cache_dir: str | os.PathLike[str] | None, capacity: int, block_size: int) -> DiskCache | None:
        """The disk layer of a remote file (None for a local one, or a store without versions)."""
        if cache_dir is None or not isinstance(self.source, FsspecFile):
            return None
        if self.source.pinned is None:
            warnings.warn(
                f"{self.url}: the store reports no version (ETag, generation or mtime), so blocks on "
                f"disk could not be told from a rewritten object's: cache_dir={os.fspath(cache_dir)!r} is not used",
                RuntimeWarning,
                stacklevel=4,
            )
            return None
        disk = DiskCache(
            self.source.read,
            cache_dir,
            identity=remote_identity(self.url, self.source.storage_options),
            version=self.source.pinned,
            size=self.size,
            block_size=block_size,
            capacity=capacity,
        )
        try:
            disk.reconcile()
        except OSError as exc:  # not a directory, not writable, a full or read-only disk
            warnings.warn(
                f"{self.url}: cache_dir={os.fspath(cache_dir)!r} cannot be used ({type(exc).__name__}: {exc}); "
                "reading on from the store without it",
                RuntimeWarning,
                stacklevel=4,
            )
            return None
        return disk

    def read(self, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` of the file (``0 <= start <= stop <= size``).

        Raises:
            FileChangedError: the file changed since it was opened.
        """
        if self._pid != os.getpid():
            self._check_process()
        return self._memory.read(start, stop)

    def _check_process(self) -> None:
        """In a new process (a worker), check that the file is still the one opened."""
        size = self.source.size()  # a remote object's version is checked against the pinned one too
        if size != self.size:
            raise FileChangedError(
                f"{self.url}: {size:,} bytes now, {self.size:,} when the reader was created: the file changed; create the reader again"
            )
        if self.pin is not None and self.local_path is not None:
            self._check_pin()
        self._pid = os.getpid()

    def read_past_memory(self, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` from the disk cache or the store, neither counted nor kept in
        memory: a header read once (a token file's) does not take a block of the memory cache."""
        if self._pid != os.getpid():
            self._check_process()
        return self._fetch_function()(start, stop)

    def stats(self) -> CacheStats:
        """This process's cache counters (the disk cache's too, with a ``cache_dir``)."""
        memory = self._memory.stats()
        return memory if self._disk is None else self._disk.stats(memory)

    def raw(self) -> CachedFileIO:
        """A seekable, read-only binary file object over the cached bytes (for pyarrow, tarfile)."""
        return CachedFileIO(self)

    def close(self) -> None:
        self.source.close()
        self._memory.clear()
        if self._disk is not None:
            self._disk.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        memory = state.pop("_memory")
        state["_memory_args"] = (memory.block_size, memory.capacity)
        state["_pid"] = -1  # checked and reopened on first use in the receiving process
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        block_size, capacity = state.pop("_memory_args")
        self.__dict__.update(state)  # the source and disk cache pickled themselves (blocks stay on disk)
        self._memory = BlockCache(self._fetch_function(), self.size, block_size, capacity)


class CachedFileIO(io.RawIOBase):
    """A ``CachedFile`` as a read-only, seekable binary file: what pyarrow and ``tarfile`` read."""

    def __init__(self, file: CachedFile) -> None:
        super().__init__()
        self.file = file
        self.name = file.url
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self.file.size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._position = base + offset
        return self._position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        stop = min(self._position + len(view), self.file.size)
        if stop <= self._position:
            return 0
        data = self.file.read(self._position, stop)
        view[: len(data)] = data
        self._position += len(data)
        return len(data)

    def readall(self) -> bytes:
        data = self.file.read(min(self._position, self.file.size), self.file.size)
        self._position = max(self._position, self.file.size)
        return data
