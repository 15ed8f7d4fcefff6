"""``TokenReader``: the design note's ``sequences(start, count)`` over a flat file of tokens.

Sequence ``i`` is the ``seq_len + 1`` tokens from token ``i * seq_len`` on, so ``row[:-1]`` and
``row[1:]`` are inputs and targets. See docs/data.md.
"""

from __future__ import annotations

import operator
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from gradientmail.data.cache import CacheStats
from gradientmail.data.errors import SequenceRangeError, ShardError, TokenFileError
from gradientmail.data.formats import FileFormat, TokenLayout, read_layout
from gradientmail.data.shard_cache import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CACHE_BYTES,
    DEFAULT_CACHE_DIR_BYTES,
    CachedFile,
    Pin,
    ShardCache,
)
from gradientmail.data.shard_reader import Permutation, ShardLike, ShardReader
from gradientmail.data.shard_units import Shard

_SIGNED = {"uint16": (torch.int16, 0xFFFF), "uint32": (torch.int32, 0xFFFFFFFF)}


def _int_at_least(name: str, value: object, minimum: int, error: type[Exception] = ValueError) -> int:
    """``value`` as an int (numpy and 0-d torch integers too); ``error`` when below ``minimum``."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an int, not {value!r}")
    value = operator.index(value)  # numpy and 0-d torch integers too
    if value < minimum:
        raise error(f"{name} must be >= {minimum}, not {value!r}")
    return value


class TokenReader:
    """Sequences of ``seq_len + 1`` tokens (``int64``) from a ``.bin`` or ``.npy`` token file.

    Args:
        url: a local path, ``file://`` URL or any fsspec URL (``s3://bucket/key`` needs s3fs).
        seq_len: tokens a model sees per sequence; rows are ``seq_len + 1`` long.
        dtype: ``"uint16"`` or ``"uint32"``; a raw ``.bin`` is ``uint16`` unless told, a
            ``.npy`` says its own (passing another one is an error).
        format: ``"auto"`` (``.npy`` by the name's suffix, else raw), ``"bin"`` or ``"npy"``.
        vocab_size: if given, every token read is checked to be below it (a wrong dtype or a
            corrupt file fails here, naming the token, instead of deep inside an embedding).
        block_size, cache_bytes: reads are whole blocks of ``block_size`` bytes and at most
            ``cache_bytes`` of them are kept, per process (LRU).
        cache_dir: a remote file's blocks are also kept in this local directory, so that a second
            pass, another worker or a restarted node reads them from disk. Processes may share it;
            entries are keyed by the object's version, so a rewritten object never serves old
            blocks. Ignored for a local file (its pages are the OS's cache already).
        cache_dir_bytes: the bound of ``cache_dir``, for all processes and files sharing it
            (least recently used blocks are evicted first).
        storage_options: passed to fsspec, e.g. ``{"endpoint_url": ...}`` for s3fs.
        pin: the size and version the file must have (``Shard.pin``), or None.

    The file is opened and checked here; a pickled copy (a DataLoader worker) reopens it on
    first use, with an empty cache, and refuses a file whose size changed meanwhile.

    Raises:
        TokenFileError: the file is not a usable token file, or holds less than one sequence.
        FileNotFoundError: there is no file at ``url``.
        FileChangedError: the file is not the pinned one.
        ValueError: ``cache_dir_bytes`` cannot hold one block.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from gradientmail.data import TokenReader, write_tokens
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     text = Path(tmp, "hello.txt")
        ...     _ = text.write_text("hello world")  # 11 bytes: 11 tokens
        ...     info = write_tokens(Path(tmp, "train.bin"), [text])
        ...     with TokenReader(info.path, seq_len=4, vocab_size=256) as reader:
        ...         batch = reader.sequences(0, len(reader))
        >>> batch.shape  # (11 - 1) // 4 sequences of 4 + 1 tokens
        torch.Size([2, 5])
        >>> [bytes(row.tolist()) for row in batch]
        [b'hello', b'o wor']
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        seq_len: int,
        dtype: str | torch.dtype | None = None,
        format: FileFormat = "auto",
        vocab_size: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_dir_bytes: int = DEFAULT_CACHE_DIR_BYTES,
        storage_options: Mapping[str, Any] | None = None,
        pin: Pin | None = None,
    ) -> None:
        if sys.byteorder != "little":  # pragma: no cover
            raise TokenFileError("token files are little-endian; this machine is big-endian")
        self.seq_len = _int_at_least("seq_len", seq_len, 1)
        self.vocab_size = None if vocab_size is None else _int_at_least("vocab_size", vocab_size, 1)
        self._file = CachedFile(
            url,
            storage_options=storage_options,
            block_size=block_size,
            cache_bytes=cache_bytes,
            cache_dir=cache_dir,
            cache_dir_bytes=cache_dir_bytes,
            pin=pin,
        )
        self.url = self._file.url
        self.layout: TokenLayout = read_layout(
            self.url, self._file.size, self._file.read_past_memory, format=format, dtype=dtype
        )
        if self.layout.tokens < seq_len + 1:
            raise TokenFileError(
                f"{self.url}: {self.layout.tokens:,} tokens, fewer than one sequence of seq_len + 1 = {seq_len + 1:,}"
            )

    # -- what the file holds ----------------------------------------------------------------
    @property
    def dtype(self) -> str:
        return self.layout.dtype

    @property
    def num_tokens(self) -> int:
        return self.layout.tokens

    def __len__(self) -> int:
        """Sequences in the file: ``(num_tokens - 1) // seq_len``."""
        return (self.layout.tokens - 1) // self.seq_len

    def cache_stats(self) -> CacheStats:
        """This process's cache counters (hits, ranged reads, bytes held and its bound; the
        ``cache_dir``'s hits and bytes too)."""
        return self._file.stats()

    def __repr__(self) -> str:
        return f"TokenReader({self.url!r}, seq_len={self.seq_len}, dtype={self.dtype!r}, tokens={self.num_tokens:,})"

    # -- reading ----------------------------------------------------------------------------
    def sequences(self, start: int, count: int) -> torch.Tensor:
        """``count`` sequences from sequence ``start``: ``int64`` of shape ``(count, seq_len + 1)``.

        Raises:
            SequenceRangeError: ``start`` or ``count`` is negative or reads past the end.
            TokenFileError: a token is not below ``vocab_size``, or the file changed.
        """
        start = _int_at_least("start", start, 0, SequenceRangeError)
        count = _int_at_least("count", count, 0, SequenceRangeError)
        if start + count > len(self):
            raise SequenceRangeError(
                f"sequences(start={start:,}, count={count:,}) reads past the end of {self.url}: "
                f"it holds {len(self):,} sequences of {self.seq_len} + 1 tokens "
                f"({self.num_tokens:,} tokens)"
            )
        if count == 0:
            return torch.empty(0, self.seq_len + 1, dtype=torch.int64)
        flat = self.tokens(start * self.seq_len, count * self.seq_len + 1)
        return flat.unfold(0, self.seq_len + 1, self.seq_len).contiguous()

    def tokens(self, start: int, count: int) -> torch.Tensor:
        """``count`` tokens from token ``start`` as a flat ``int64`` tensor.

        Raises:
            SequenceRangeError: ``start`` or ``count`` is negative or reads past the end.
            TokenFileError: a token is not below ``vocab_size``, or the file changed.
        """
        start = _int_at_least("start", start, 0, SequenceRangeError)
        count = _int_at_least("count", count, 0, SequenceRangeError)
        if start + count > self.num_tokens:
            raise SequenceRangeError(
                f"tokens(start={start:,}, count={count:,}) reads past the end of {self.url} "
                f"({self.num_tokens:,} tokens)"
            )
        itemsize = self.layout.itemsize
        offset = self.layout.offset + start * itemsize
        data = bytearray(self._file.read(offset, offset + count * itemsize))
        signed, mask = _SIGNED[self.dtype]
        values = (
            torch.frombuffer(data, dtype=signed).to(torch.int64) & mask if data else (torch.empty(0, dtype=torch.int64))
        )
        if self.vocab_size is not None and values.numel() and int(values.max()) >= self.vocab_size:
            at = int(torch.argmax((values >= self.vocab_size).to(torch.int8)))
            raise TokenFileError(
                f"{self.url}: token {int(values[at]):,} at position {start + at:,} is not below "
                f"vocab_size={self.vocab_size:,} (a wrong dtype, or a file of another tokenizer?)"
            )
        return values

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> TokenReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class TokenShardReader(ShardReader):
    """A token file shard (``.bin``, ``.npy``) as batches of ``batch_size`` sequences, in file order:
    ``{"input_ids": rows[:, :-1], "labels": rows[:, 1:]}`` (the last batch may hold fewer).

    Args:
        seq_len, dtype, vocab_size: as ``TokenReader``'s.
        batch_size: sequences per batch.
        cache, storage_options, shuffle: as ``ShardReader``'s (shuffled, the sequences are read
            one by one, in the order drawn).

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from gradientmail.data import TokenShardReader, write_tokens
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     _ = Path(tmp, "t.txt").write_text("hello world")
        ...     info = write_tokens(Path(tmp, "train.bin"), [Path(tmp, "t.txt")])
        ...     pairs = list(TokenShardReader(seq_len=4, batch_size=1)(info.path))
        >>> [(index, batch["input_ids"].shape) for index, batch in pairs]
        [(0, torch.Size([1, 4])), (1, torch.Size([1, 4]))]
    """

    def __init__(
        self,
        *,
        seq_len: int,
        batch_size: int,
        dtype: str | torch.dtype | None = None,
        vocab_size: int | None = None,
        cache: ShardCache | None = None,
        storage_options: Mapping[str, Any] | None = None,
        shuffle: bool = False,
    ) -> None:
        super().__init__(cache=cache, storage_options=storage_options, shuffle=shuffle)
        self.seq_len = _int_at_least("seq_len", seq_len, 1)
        self.batch_size = _int_at_least("batch_size", batch_size, 1)
        self.dtype = dtype
        self.vocab_size = vocab_size

    def batches(self, shard: ShardLike, permutation: Permutation | None = None) -> Iterator[dict[str, torch.Tensor]]:
        pin = shard.pin if isinstance(shard, Shard) else None
        url = shard.url if isinstance(shard, Shard) else shard
        reader = TokenReader(
            url,
            seq_len=self.seq_len,
            dtype=self.dtype,
            vocab_size=self.vocab_size,
            block_size=self.cache.block_size,
            cache_bytes=self.cache.memory_bytes,
            cache_dir=self.cache.directory,
            cache_dir_bytes=self.cache.max_bytes,
            storage_options=self.storage_options or None,
            pin=pin,
        )
        with reader:
            order = None if permutation is None else permutation(len(reader))
            if order is not None and sorted(order) != list(range(len(reader))):
                raise ShardError(f"permutation({len(reader)}) returned no permutation of the file's sequences")
            for start in range(0, len(reader), self.batch_size):
                if order is None:
                    rows = reader.sequences(start, min(self.batch_size, len(reader) - start))
                else:
                    rows = torch.cat([reader.sequences(index, 1) for index in order[start : start + self.batch_size]])
                yield {"input_ids": rows[:, :-1], "labels": rows[:, 1:]}
