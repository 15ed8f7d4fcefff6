"""Shards as units: the files of a local or remote prefix as a units mapping, named and pinned stably.

A unit's identifier is its file's path relative to the prefix (the same on every node, whatever
the store's listing order), and its value a frozen ``Shard`` that pins the size and version seen
when listed, so that a file replaced during a run is refused when read instead of mixing data.
Large files may be split: Parquet by rows (whole row groups where they fit), JSON Lines by bytes
(each line read by the part in which it starts).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from gradientmail.data.errors import ShardError
from gradientmail.data.shard_cache import Pin, ShardCache
from gradientmail.data.sources import object_version
from gradientmail.errors import MissingExtraError

FORMATS: dict[str, str] = {
    ".parquet": "parquet",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".tar": "tar",
    ".bin": "tokens",
    ".npy": "tokens",
}
"""A file's format by its suffix; any other file is ``"other"`` (listed, read by your own loader)."""
COMPRESSED: dict[str, str] = {".jsonl.gz": "jsonl", ".ndjson.gz": "jsonl"}
"""Gzipped formats: read whole (a gzip stream cannot be entered mid-way, so never split)."""

GLOB_CHARACTERS = "*?["


class Part(NamedTuple):
    """The share of a file one unit covers: rows ``[start, stop)`` of a Parquet file, or the lines of
    a JSON Lines file that start in bytes ``[start, stop)``."""

    kind: Literal["rows", "bytes"]
    start: int
    stop: int


@dataclass(frozen=True)
class Shard:
    """One unit of data: a file (or a ``part`` of one) with the size and version it was listed at.

    Attributes:
        url: where to read it: a local path or a URL with its protocol (``s3://bucket/key``).
        path: the file's path relative to the listed prefix.
        size: its size in bytes when listed.
        version: its ETag, generation or modification time when listed (None: the store has none).
        part: the rows or bytes this unit covers, or None for the whole file.
    """

    url: str
    path: str
    size: int
    version: str | None
    part: Part | None = None
    width: int = 0
    """Digits of the part's numbers in ``id``, so that identifiers sort in row order."""

    @property
    def id(self) -> str:
        """The unit's identifier: ``path``, and ``@rows=a-b`` or ``@bytes=a-b`` for a part (numbers
        zero-padded to one width per file: every listing sorts the parts in file order)."""
        if self.part is None:
            return self.path
        part, width = self.part, self.width
        return f"{self.path}@{part.kind}={part.start:0{width}d}-{part.stop:0{width}d}"

    @property
    def pin(self) -> Pin:
        """What the file must still be when read (readers check it)."""
        return Pin(self.size, self.version)

    @property
    def format(self) -> str:
        """``"parquet"``, ``"jsonl"``, ``"tar"``, ``"tokens"`` (by suffix) or ``"other"``."""
        return shard_format(self.path)


def shard_format(path: str) -> str:
    """The format a file name says (``FORMATS``), or ``"other"``.

    Example:
        >>> shard_format("train/part-00001.parquet"), shard_format("web/en-0001.jsonl.gz")
        ('parquet', 'jsonl')
    """
    lower = path.lower()
    for suffix, found in COMPRESSED.items():
        if lower.endswith(suffix):
            return found
    return FORMATS.get(os.path.splitext(lower)[1], "other")


def shards(
    url_or_glob: str | os.PathLike[str],
    *,
    split: int | None = None,
    split_bytes: int | None = None,
    suffixes: Iterable[str] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    cache: ShardCache | None = None,
) -> dict[str, Shard]:
    """The files under a prefix, or matching a glob, as units: ``{relative path: Shard}``, sorted.

    Every node that lists the same files builds the same mapping, so it is ``shared_queue``'s
    ``units`` as it is. Names starting with ``.`` or ``_`` (hidden files, ``_SUCCESS`` markers)
    are left out, at any depth.

    Args:
        url_or_glob: a local directory or file, or any fsspec URL (``s3://bucket/train/`` through
            s3fs, which honours ``AWS_ENDPOINT_URL``), optionally with a glob
            (``s3://bucket/train/*.parquet``); identifiers are relative to the part before the
            first glob character's directory.
        split: rows per unit of a Parquet file: its row groups are packed into units of at most
            ``split`` rows (a larger row group is cut), read from the footers when listing (needs
            pyarrow). None: one unit per file.
        split_bytes: bytes per unit of a JSON Lines file (a line belongs to the unit in which it
            starts, so no line is read twice or missed). None: one unit per file. A gzipped
            one (``.jsonl.gz``) stays one unit: a gzip stream cannot be entered mid-way.
        suffixes: keep only files with one of these suffixes (``[".parquet"]``).
        storage_options: passed to fsspec (``{"endpoint_url": ...}`` for s3fs).
        cache: read the footers for ``split`` through this cache (the readers' ``ShardCache``):
            with a directory, another listing on the machine (a restarted node, another rank)
            fetches no footer byte from the store, only checks each file's version.

    Raises:
        FileNotFoundError: no file matched.
        ShardError: a split that is not a positive number.
        MissingExtraError: fsspec cannot reach the protocol, or ``split`` without pyarrow.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from gradientmail.data import shards
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     for name in ("b.jsonl", "a.jsonl", "sub/c.jsonl", "_SUCCESS"):
        ...         Path(tmp, name).parent.mkdir(exist_ok=True)
        ...         _ = Path(tmp, name).write_text('{"x": 1}\\n' * 10)
        ...     units = shards(tmp, split_bytes=64)
        >>> list(units)
        ['a.jsonl@bytes=00-64', 'a.jsonl@bytes=64-90', 'b.jsonl@bytes=00-64', 'b.jsonl@bytes=64-90', 'sub/c.jsonl@bytes=00-64', 'sub/c.jsonl@bytes=64-90']
    """
    for name, value in (("split", split), ("split_bytes", split_bytes)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ShardError(f"{name} must be a positive number or None, not {value!r}")
    url = os.fspath(url_or_glob)
    options = dict(storage_options or {})
    fs, base, found = _listing(url, options)
    kept = [] if suffixes is None else [suffix.lower() for suffix in suffixes]
    units: dict[str, Shard] = {}
    for name in sorted(found):
        info = found[name]
        relative = name[len(base) :].lstrip("/") if base else name
        if not relative or any(segment[:1] in "._" for segment in relative.split("/")):
            continue
        if kept and not relative.lower().endswith(tuple(kept)):
            continue
        whole = Shard(_full_url(fs, name), relative, int(info["size"]), object_version(info))
        for shard in _parts(fs, name, whole, split, split_bytes, cache, options):
            units[shard.id] = shard
    if not units:
        raise FileNotFoundError(
            f"no shards at {url}: {len(found)} files listed, none kept"
            + (f" (suffixes {kept})" if kept else "")
            + " (names starting with '.' or '_' are left out)"
        )
    return dict(sorted(units.items()))


def _listing(url: str, options: dict[str, Any]) -> tuple[Any, str, dict[str, dict[str, Any]]]:
    """The filesystem, the prefix identifiers are relative to, and ``{name: info}`` of the files."""
    import fsspec  # a dependency of torch

    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as exc:
        protocol = url.partition("://")[0]
        raise MissingExtraError(
            f"{url}: fsspec cannot load the filesystem for {protocol!r}: {exc} "
            "(for s3://: pip install 'gradientmail[fsspec]')"
        ) from exc
    fs.invalidate_cache()  # the store's listing now, not one cached by an earlier call
    magic = min((path.index(c) for c in GLOB_CHARACTERS if c in path), default=-1)
    if magic >= 0:
        base = path[:magic].rpartition("/")[0]
        found = fs.glob(path, detail=True)
    elif fs.isfile(path):
        base, found = path.rpartition("/")[0], {path: fs.info(path)}
    else:
        base, found = path.rstrip("/"), fs.find(path, detail=True)
    return fs, base, {name: info for name, info in found.items() if info.get("type") == "file"}


def is_gzip(path: str) -> bool:
    """Whether a shard's name says gzip (``.jsonl.gz``): read whole, decompressed as it streams."""
    return path.lower().endswith(".gz")


def _full_url(fs: Any, name: str) -> str:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return name if protocol in ("file", "local") else fs.unstrip_protocol(name)


def _parts(
    fs: Any,
    name: str,
    whole: Shard,
    split: int | None,
    split_bytes: int | None,
    cache: ShardCache | None,
    options: dict[str, Any],
) -> list[Shard]:
    if split is not None and whole.format == "parquet":
        parts = row_parts(_row_groups(fs, name, whole, cache, options), split)
    elif split_bytes is not None and whole.format == "jsonl" and whole.size > split_bytes and not is_gzip(whole.path):
        parts = [
            Part("bytes", start, min(start + split_bytes, whole.size)) for start in range(0, whole.size, split_bytes)
        ]
    else:
        parts = []
    if len(parts) <= 1:
        return [whole]
    width = len(str(parts[-1].stop))
    return [Shard(whole.url, whole.path, whole.size, whole.version, part, width) for part in parts]


def _row_groups(fs: Any, name: str, whole: Shard, cache: ShardCache | None, options: dict[str, Any]) -> list[int]:
    """The rows of each row group of a Parquet file, from its footer (one or two ranged reads,
    through ``cache`` when given: pinned to the version listed)."""
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise MissingExtraError(
            f"splitting Parquet files needs pyarrow: pip install 'gradientmail[parquet]' ({exc})"
        ) from exc
    if cache is not None:
        file = cache.open(whole.url, options or None, pin=whole.pin)
        stream: Any = file.local_path or file.raw()
        close = file.close
    else:
        stream = fs.open(name, "rb")
        close = stream.close
    try:
        metadata = pq.ParquetFile(stream).metadata
    except (OSError, ValueError) as exc:  # pyarrow.ArrowInvalid is a ValueError
        raise ShardError(f"{name}: not a readable Parquet file, so it cannot be split by rows ({exc})") from exc
    finally:
        close()
    return [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]


def row_parts(group_rows: list[int], split: int) -> list[Part]:
    """Consecutive row groups packed into parts of at most ``split`` rows; a larger group is cut
    into equal parts. Parts never share a row group they could keep whole, so no group is decoded
    twice except one that is cut.

    Example:
        >>> [(p.start, p.stop) for p in row_parts([40, 40, 40, 250], 100)]
        [(0, 80), (80, 120), (120, 203), (203, 286), (286, 370)]
    """
    parts: list[Part] = []
    start = first = 0
    for rows in group_rows:
        if rows > split or start + rows - first > split:
            if start > first:
                parts.append(Part("rows", first, start))
            first = start
        if rows > split:
            pieces = -(-rows // split)
            bounds = [start + rows * i // pieces for i in range(pieces + 1)]
            parts.extend(Part("rows", a, b) for a, b in zip(bounds, bounds[1:]))
            first = start + rows
        start += rows
    if start > first:
        parts.append(Part("rows", first, start))
    return parts
