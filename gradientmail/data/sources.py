"""Ranged reads of one file, on local disk or any fsspec URL, safe to pickle into workers.

A source holds only its address and opens the file (or fsspec filesystem, which does not survive
a fork) on first use in each process, so each DataLoader worker reads through its own handles.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

from gradientmail.data.errors import FileChangedError, TokenFileError
from gradientmail.errors import MissingExtraError


class ByteSource(Protocol):
    """What a ``TokenReader`` reads through: a file's size and ranges of its bytes."""

    name: str

    def size(self) -> int: ...

    def read(self, start: int, stop: int) -> bytes: ...

    def close(self) -> None: ...


def open_source(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> ByteSource:
    """A local path or ``file://`` URL → ``LocalFile``; any other URL → ``FsspecFile``.

    Raises:
        TypeError: ``url`` is not a non-empty path, or ``storage_options`` came with a local file.
    """
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url:
        raise TypeError(f"a token file is a non-empty path or URL, not {url!r}")
    scheme, sep, _ = url.partition("://")
    if not sep or scheme.lower() == "file":
        if storage_options:
            raise TypeError(f"storage_options apply to fsspec URLs, not the local file {url!r}")
        return LocalFile(unquote(urlsplit(url).path) if sep else url)
    return FsspecFile(url, dict(storage_options or {}))


def _whole_range(name: str, data: bytes, start: int, stop: int) -> bytes:
    """``data`` when it is all of bytes ``[start, stop)``; a ``TokenFileError`` when it is short."""
    if len(data) != stop - start:
        raise TokenFileError(
            f"{name}: asked for bytes {start:,}-{stop:,}, got {len(data):,}: the file changed "
            "or shrank while it was being read"
        )
    return data


class LocalFile:
    """A file on local disk, read with ``os.pread`` (no shared file position between threads)."""

    def __init__(self, path: str) -> None:
        self.name = path
        self._fd: int | None = None
        self._pid = -1
        self._lock = threading.Lock()

    def _descriptor(self) -> int:
        with self._lock:
            if self._fd is None or self._pid != os.getpid():
                try:
                    self._fd = os.open(self.name, os.O_RDONLY | getattr(os, "O_BINARY", 0))
                except FileNotFoundError:
                    raise FileNotFoundError(f"no token file at {self.name}") from None
                self._pid = os.getpid()
            return self._fd

    def size(self) -> int:
        return os.fstat(self._descriptor()).st_size

    def read(self, start: int, stop: int) -> bytes:
        fd = self._descriptor()
        if hasattr(os, "pread"):
            chunks, at = [], start
            while at < stop:
                chunk = os.pread(fd, stop - at, at)
                if not chunk:
                    break
                chunks.append(chunk)
                at += len(chunk)
            return _whole_range(self.name, b"".join(chunks), start, stop)
        with self._lock:  # pragma: no cover - platforms without pread share one file position
            os.lseek(fd, start, os.SEEK_SET)
            return _whole_range(self.name, os.read(fd, stop - start), start, stop)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None and self._pid == os.getpid():  # a parent's descriptor is not ours
            os.close(fd)

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            self.close()

    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["name"])  # type: ignore[misc]


VERSION_FIELDS = ("ETag", "etag", "VersionId", "generation", "md5Hash", "LastModified", "mtime")
"""Fields of an fsspec ``info()`` that change when the object is rewritten, in order of trust."""


class FsspecFile:
    """A file at an fsspec URL (``s3://`` through s3fs, ``gs://``, ``https://``...).

    The object's version (its ETag, generation or modification time) is pinned when its size is
    first read; every block read after that checks it (one metadata request), so a reader never
    mixes blocks of two versions of an object overwritten during a run: it raises instead.
    """

    def __init__(self, url: str, storage_options: dict[str, Any], pinned: str | None = None) -> None:
        self.name = url
        self.storage_options = storage_options
        self.pinned = pinned
        """The object's version when it was opened (None: the store reports none)."""
        self._fs: Any = None
        self._path = ""
        self._pid = -1

    def _filesystem(self) -> tuple[Any, str]:
        if self._fs is None or self._pid != os.getpid():
            import fsspec  # a dependency of torch

            try:
                self._fs, self._path = fsspec.core.url_to_fs(self.name, **self.storage_options)
            except ImportError as exc:
                protocol = self.name.partition("://")[0]
                raise MissingExtraError(
                    f"{self.name}: fsspec cannot load the filesystem for {protocol!r}: {exc} "
                    "(for s3://: pip install 'gradientmail[fsspec]')"
                ) from exc
            self._pid = os.getpid()
        return self._fs, self._path

    def _info(self) -> dict[str, Any]:
        fs, path = self._filesystem()
        fs.invalidate_cache(path)  # the store's answer now, not a listing cached earlier
        try:
            return fs.info(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"no token file at {self.name}") from None

    def size(self) -> int:
        info = self._info()
        size = info.get("size")
        if not isinstance(size, int) or size < 0:
            raise TokenFileError(f"{self.name}: the store reports no size ({size!r})")
        version = object_version(info)
        if self.pinned is None:
            self.pinned = version
        elif version != self.pinned:
            raise self._changed(version)
        return size

    def read(self, start: int, stop: int) -> bytes:
        fs, path = self._filesystem()
        data = fs.cat_file(path, start=start, end=stop)
        if self.pinned is not None:
            version = object_version(self._info())
            if version != self.pinned:
                raise self._changed(version)
        return _whole_range(self.name, data, start, stop)

    def _changed(self, version: str | None) -> FileChangedError:
        return FileChangedError(
            f"{self.name} changed while it was being read (version {self.pinned!r} when opened, "
            f"now {version!r}): blocks of two versions would be mixed; open a new reader "
            "(and do not overwrite a file during a run: write a new one)"
        )

    def close(self) -> None:
        self._fs = None

    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.name, "storage_options": self.storage_options, "pinned": self.pinned}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["name"], state["storage_options"], state.get("pinned"))  # type: ignore[misc]


def object_version(info: Mapping[str, Any]) -> str | None:
    """The first of ``VERSION_FIELDS`` an fsspec ``info()`` holds, as ``"name=value"`` (None: none).

    Example:
        >>> object_version({"size": 3, "ETag": '"abc"'})
        'ETag="abc"'
    """
    for name in VERSION_FIELDS:
        value = info.get(name)
        if value not in (None, ""):
            return f"{name}={value}"
    return None
