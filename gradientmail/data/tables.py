"""Parquet and JSON Lines shards as batches of rows, read with pyarrow (the ``parquet`` extra).

A batch is what ``collate`` makes of a ``pyarrow.RecordBatch`` of ``batch_rows`` rows (fewer at
the end of a unit); the default, ``to_tensors``, gives a dict of one tensor per column.
"""

from __future__ import annotations

import importlib
import io
import sys
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from gradientmail.data.errors import ShardError
from gradientmail.data.shard_cache import CachedFile, ShardCache
from gradientmail.data.shard_reader import Permutation, ShardLike, ShardReader
from gradientmail.data.shard_units import Shard, is_gzip
from gradientmail.errors import MissingExtraError

DEFAULT_BATCH_ROWS = 1024
FOOTERS_KEPT = 256
"""Parquet footers a process keeps (a few KB to a few MB each)."""


def pyarrow_module(name: str = "pyarrow") -> Any:
    """``pyarrow`` (or one of its modules), or ``MissingExtraError`` naming the install."""
    module = sys.modules.get(name)
    if module is not None:
        return module
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise MissingExtraError(
            f"reading Parquet and JSON Lines needs pyarrow: pip install 'gradientmail[parquet]' ({exc})"
        ) from exc


def to_tensors(batch: Any) -> dict[str, torch.Tensor | list[torch.Tensor]]:
    """A ``pyarrow.RecordBatch`` as ``{column: tensor}``: the default ``collate`` (module level, so
    DataLoader workers pickle it).

    Numbers and booleans become 1-D tensors; lists of numbers a 2-D tensor when every row has the
    same length (token ids of packed sequences), else a list of 1-D tensors.

    Raises:
        ShardError: a column holds strings, bytes or nulls (no tensor holds them): leave it out
            with ``columns=``, or pass a ``collate`` that converts it (a tokenizer).
    """
    return {name: column_tensor(name, column) for name, column in zip(batch.schema.names, batch.columns)}


def column_tensor(name: str, column: Any) -> torch.Tensor | list[torch.Tensor]:
    """One Arrow column as a tensor (see ``to_tensors``)."""
    types = pyarrow_module().types
    kind = column.type
    if column.null_count:
        raise ShardError(f"column {name!r} holds {column.null_count} nulls, which no tensor holds: {_fix(name)}")
    if types.is_integer(kind) or types.is_floating(kind) or types.is_boolean(kind):
        return torch.from_numpy(column.to_numpy(zero_copy_only=False, writable=True))
    if types.is_list(kind) or types.is_large_list(kind) or types.is_fixed_size_list(kind):
        flat = column.flatten()
        if flat.null_count or not (types.is_integer(flat.type) or types.is_floating(flat.type)):
            raise ShardError(f"column {name!r} is a list of {flat.type}, not of numbers: {_fix(name)}")
        values = torch.from_numpy(flat.to_numpy(zero_copy_only=False, writable=True))
        if types.is_fixed_size_list(kind):
            return values.reshape(len(column), kind.list_size)
        offsets = column.offsets.to_numpy()
        lengths = offsets[1:] - offsets[:-1]
        if len(column) and (lengths == lengths[0]).all():
            return values.reshape(len(column), int(lengths[0]))
        return list(torch.split(values, lengths.tolist()))
    raise ShardError(f"column {name!r} holds {kind} values, which no tensor holds: {_fix(name)}")


def _fix(name: str) -> str:
    return (
        f"leave it out (columns=[...] without {name!r}) or pass collate=, a module-level function "
        "from a pyarrow.RecordBatch to tensors (one that tokenizes text, for example)"
    )


def rebatched(batches: Iterable[Any], rows: int) -> Iterator[Any]:
    """Record batches cut and joined into batches of exactly ``rows`` rows (the last one fewer).

    A batch inside one input batch is a zero-copy slice of it; only a batch that straddles two
    input batches (after a row group's end) is copied.
    """
    carry = None  # fewer than ``rows`` rows left over from the previous input batches
    for batch in batches:
        at = 0
        if carry is not None:
            need = rows - len(carry)
            if len(batch) < need:
                carry = _joined([carry, batch])
                continue
            yield _joined([carry, batch.slice(0, need)])
            at, carry = need, None
        while len(batch) - at >= rows:
            yield batch if (at, len(batch)) == (0, rows) else batch.slice(at, rows)
            at += rows
        if at < len(batch):
            carry = batch.slice(at)
    if carry is not None and len(carry):
        yield carry


def shuffled(batches: Iterable[Any], permutation: Permutation, rows: int) -> Iterator[Any]:
    """All of ``batches``' rows, in the order ``permutation(count)`` gives, ``rows`` at a time.

    Raises:
        ShardError: the order is not a permutation of the rows.
    """
    pa = pyarrow_module()
    collected = list(batches)
    if not collected:
        return
    table = pa.Table.from_batches(collected)
    order = permutation(table.num_rows)
    if sorted(order) != list(range(table.num_rows)):
        raise ShardError(f"permutation({table.num_rows}) returned no permutation of the unit's rows")
    yield from rebatched(table.take(pa.array(order, type=pa.int64())).to_batches(max_chunksize=rows), rows)


def _joined(batches: list[Any]) -> Any:
    """Record batches of one schema as one (their rows copied into one chunk per column)."""
    return pyarrow_module().Table.from_batches(batches).combine_chunks().to_batches()[0]


def _check_rows(batch_rows: int) -> int:
    if isinstance(batch_rows, bool) or not isinstance(batch_rows, int) or batch_rows < 1:
        raise ValueError(f"batch_rows must be a positive number of rows, not {batch_rows!r}")
    return batch_rows


class FooterCache:
    """Parquet footers by file and pinned version, so the units split from one file parse (and,
    remote, fetch) its footer once per process rather than once per unit.

    Only pinned files (a ``Shard``'s) are kept: the pin is checked when the file is opened, so a
    footer kept for ``(url, size, version)`` is that file's. Least recently used footers go first.
    """

    def __init__(self, kept: int = FOOTERS_KEPT) -> None:
        self.kept = kept
        self.footers: OrderedDict[tuple[str, int, str], Any] = OrderedDict()
        self.parsed = 0
        """Footers parsed from a file (not served from here): what tests and benchmarks count."""

    def open(self, file: CachedFile) -> Any:
        """``pyarrow.parquet.ParquetFile`` over ``file``, its footer parsed once per pinned version."""
        pq = pyarrow_module("pyarrow.parquet")
        source = file.local_path or file.raw()
        pin = file.pin
        key = None if pin is None or pin.version is None else (file.url, pin.size, pin.version)
        metadata = None if key is None else self.footers.get(key)
        if metadata is not None:
            self.footers.move_to_end(key)
            return pq.ParquetFile(source, metadata=metadata)
        parquet = pq.ParquetFile(source)
        self.parsed += 1
        if key is not None:
            self.footers[key] = parquet.metadata
            while len(self.footers) > self.kept:
                self.footers.popitem(last=False)
        return parquet


FOOTERS = FooterCache()
"""This process's footers (a DataLoader worker inherits a copy, or starts empty under spawn)."""


class TableReader(ShardReader):
    """A shard of rows read with pyarrow: ``record_batches`` gives its ``pyarrow.RecordBatch``es of
    ``batch_rows`` rows, and each batch is what ``collate`` makes of one.

    Args:
        batch_rows: rows per batch (the last batch of a unit may hold fewer).
        collate: turns each ``pyarrow.RecordBatch`` into the batch (``to_tensors``; module level).
        cache, storage_options, shuffle: as ``ShardReader``'s.
    """

    def __init__(
        self,
        *,
        batch_rows: int,
        collate: Callable[[Any], Any],
        cache: ShardCache | None,
        storage_options: Mapping[str, Any] | None,
        shuffle: bool,
    ) -> None:
        super().__init__(cache=cache, storage_options=storage_options, shuffle=shuffle)
        self.batch_rows = _check_rows(batch_rows)
        self.collate = collate

    def batches(self, shard: ShardLike, permutation: Permutation | None = None) -> Iterator[Any]:
        found = self.record_batches(shard)
        for batch in found if permutation is None else shuffled(found, permutation, self.batch_rows):
            yield self.collate(batch)

    @abstractmethod
    def record_batches(self, shard: ShardLike) -> Iterator[Any]:
        """The shard's rows as ``pyarrow.RecordBatch``es of ``batch_rows`` rows, before ``collate``."""


class ParquetReader(TableReader):
    """A Parquet shard's rows as batches; a ``Shard`` split by rows reads only its row groups.

    Args:
        batch_rows: rows per batch (the last batch of a unit may hold fewer).
        columns: the columns to read (None: all).
        collate: turns each ``pyarrow.RecordBatch`` into the batch (``to_tensors``; module level).
        cache, storage_options, shuffle: as ``ShardReader``'s.

    Example:
        >>> import tempfile
        >>> import pyarrow as pa, pyarrow.parquet as pq
        >>> from gradientmail.data import ParquetReader
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     pq.write_table(pa.table({"x": list(range(5))}), f"{tmp}/a.parquet")
        ...     batches = list(ParquetReader(batch_rows=2)(f"{tmp}/a.parquet"))
        >>> [(index, batch["x"].tolist()) for index, batch in batches]
        [(0, [0, 1]), (1, [2, 3]), (2, [4])]
    """

    def __init__(
        self,
        *,
        batch_rows: int = DEFAULT_BATCH_ROWS,
        columns: Sequence[str] | None = None,
        collate: Callable[[Any], Any] = to_tensors,
        cache: ShardCache | None = None,
        storage_options: Mapping[str, Any] | None = None,
        shuffle: bool = False,
    ) -> None:
        super().__init__(
            batch_rows=batch_rows, collate=collate, cache=cache, storage_options=storage_options, shuffle=shuffle
        )
        self.columns = None if columns is None else list(columns)

    def record_batches(self, shard: ShardLike) -> Iterator[Any]:
        """The shard's rows as ``pyarrow.RecordBatch``es of ``batch_rows`` rows, before ``collate``."""
        file = self.open(shard)
        try:
            parquet = FOOTERS.open(file)
            part = shard.part if isinstance(shard, Shard) else None
            if part is None:
                found = parquet.iter_batches(batch_size=self.batch_rows, columns=self.columns)
                yield from rebatched(found, self.batch_rows)
                return
            groups, offset = [], None
            first = 0
            for index in range(parquet.metadata.num_row_groups):
                rows = parquet.metadata.row_group(index).num_rows
                if first < part.stop and first + rows > part.start:
                    groups.append(index)
                    offset = first if offset is None else offset
                first += rows
            if part.stop > first:
                raise ShardError(f"{file.url} holds {first:,} rows, fewer than its part {part} (rewritten?)")
            if groups:
                # The unit's row groups decoded at once (a unit is sized to be held: ``split=``):
                # a reader per unit would restart pyarrow's streaming pipeline for every unit
                # (12-30 % more CPU per row than reading the whole file), one read does not.
                table = parquet.read_row_groups(groups, columns=self.columns)
                table = table.slice(part.start - offset, part.stop - part.start)
                yield from rebatched(table.to_batches(max_chunksize=self.batch_rows), self.batch_rows)
        finally:
            file.close()


class JsonLinesReader(TableReader):
    """A JSON Lines shard's rows as batches (one JSON object a line, parsed by pyarrow); a
    ``.jsonl.gz`` one is decompressed as it is parsed.

    A ``Shard`` split by bytes reads the lines that start in its byte range: every line of the
    file once across its units, whatever their boundaries.

    Args:
        batch_rows: rows per batch (the last batch of a unit may hold fewer).
        schema: a ``pyarrow.Schema`` for the columns (None: inferred per unit, so give one when
            a column could read as integers in one unit and floats in another).
        collate, cache, storage_options, shuffle: as ``ParquetReader``'s.
    """

    def __init__(
        self,
        *,
        batch_rows: int = DEFAULT_BATCH_ROWS,
        schema: Any = None,
        collate: Callable[[Any], Any] = to_tensors,
        cache: ShardCache | None = None,
        storage_options: Mapping[str, Any] | None = None,
        shuffle: bool = False,
    ) -> None:
        super().__init__(
            batch_rows=batch_rows, collate=collate, cache=cache, storage_options=storage_options, shuffle=shuffle
        )
        self.schema = schema

    def record_batches(self, shard: ShardLike) -> Iterator[Any]:
        """The shard's rows as ``pyarrow.RecordBatch``es of ``batch_rows`` rows, before ``collate``."""
        json = pyarrow_module("pyarrow.json")
        pa = pyarrow_module()
        options = json.ParseOptions(explicit_schema=self.schema) if self.schema is not None else None
        file = self.open(shard)
        try:
            part = shard.part if isinstance(shard, Shard) else None
            if file.size == 0:
                return
            if is_gzip(file.url):
                if part is not None:
                    raise ShardError(f"{file.url}: a gzipped file is read whole, not by {part} (list it again)")
                # Decompressed as pyarrow parses it (the file open until then); the unit's rows are
                # held at once, as for any unit.
                raw = pa.OSFile(file.local_path) if file.local_path else pa.PythonFile(file.raw(), mode="r")
                try:
                    with pa.CompressedInputStream(raw, "gzip") as stream:
                        table = json.read_json(stream, parse_options=options)
                except ShardError:
                    raise
                except (OSError, ValueError) as exc:  # zlib's errors, pyarrow.ArrowInvalid
                    raise ShardError(f"{file.url}: not a readable gzipped JSON Lines file ({exc})") from exc
            else:
                if part is None and file.local_path:
                    source: Any = file.local_path  # pyarrow reads (and parses, in parallel blocks) the file itself
                else:
                    data = _lines(file, 0 if part is None else part.start, file.size if part is None else part.stop)
                    if not data.strip():
                        return
                    source = pa.BufferReader(data)
                table = json.read_json(source, parse_options=options)
        finally:
            file.close()
        yield from rebatched(table.to_batches(max_chunksize=self.batch_rows), self.batch_rows)


def _lines(file: CachedFile, start: int, stop: int) -> bytes:
    """The bytes of the lines that start in ``[start, stop)`` (a line starts at 0 or after a newline)."""
    raw: Any = open(file.local_path, "rb") if file.local_path else io.BufferedReader(file.raw(), 1 << 20)
    with raw as stream:
        if start > 0:
            stream.seek(start - 1)
            stream.readline()  # the end of the line that started before this part: the previous part's
        begin = stream.tell()
        if begin >= stop:
            return b""
        data = stream.read(stop - begin)
        if data and not data.endswith(b"\n"):
            data += stream.readline()  # the line started here, ends in the next part
        return data
