"""Real data for the shared queue: files as units, their readers, epochs and mixtures of sources.

``shards(url)`` lists a local or remote prefix as units (``Shard`` values pinning each file's
version); ``ParquetReader``, ``JsonLinesReader``, ``TarReader`` and ``TokenShardReader`` read one
through a ``ShardCache`` (memory, and a disk directory shared by the machine's processes).
``epochs`` makes several seeded passes over units one run, and ``mix`` interleaves several
sources by weight. ``TokenReader.sequences(start, count)`` reads a token file by position;
``write_tokens`` and ``text_files`` write one, ``build_stdlib_corpus`` builds one from the Python
standard library, and ``gradientmail tokens`` does the same from the shell. Everything read is
untrusted and checked (``TokenFileError``, ``ShardError``, ``SequenceRangeError``). See docs/data.md.
"""

from __future__ import annotations

from gradientmail.data.cache import CacheStats
from gradientmail.data.corpus import Corpus, build_stdlib_corpus, stdlib_files
from gradientmail.data.epoch_units import EpochUnit, epochs, permutation
from gradientmail.data.errors import FileChangedError, SequenceRangeError, ShardError, TokenFileError
from gradientmail.data.mixture import SourceUnit, mix
from gradientmail.data.reader import TokenReader, TokenShardReader
from gradientmail.data.shard_cache import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CACHE_BYTES,
    DEFAULT_CACHE_DIR_BYTES,
    CachedFile,
    Pin,
    ShardCache,
)
from gradientmail.data.shard_reader import ShardReader
from gradientmail.data.shard_units import Part, Shard, shard_format, shards
from gradientmail.data.tables import JsonLinesReader, ParquetReader, to_tensors
from gradientmail.data.webdataset import TarReader, decode_fields, stack_samples
from gradientmail.data.writer import TokenFileInfo, Tokenizer, text_files, write_tokens

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_CACHE_BYTES",
    "DEFAULT_CACHE_DIR_BYTES",
    "CacheStats",
    "CachedFile",
    "Corpus",
    "EpochUnit",
    "SequenceRangeError",
    "SourceUnit",
    "FileChangedError",
    "JsonLinesReader",
    "ParquetReader",
    "Part",
    "Pin",
    "SequenceRangeError",
    "Shard",
    "ShardCache",
    "ShardError",
    "ShardReader",
    "TarReader",
    "TokenFileError",
    "TokenFileInfo",
    "TokenReader",
    "TokenShardReader",
    "Tokenizer",
    "build_stdlib_corpus",
    "epochs",
    "mix",
    "permutation",
    "decode_fields",
    "shard_format",
    "shards",
    "stack_samples",
    "stdlib_files",
    "text_files",
    "to_tensors",
    "write_tokens",
]
