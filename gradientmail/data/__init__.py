"""Real data for the shared queue: ``TokenReader.sequences(start, count)`` over a token file.

``write_tokens`` and ``text_files`` write such a file, ``build_stdlib_corpus`` builds one from the
Python standard library, and ``gradientmail tokens`` does the same from the shell. Everything read
is untrusted and checked (``TokenFileError``, ``SequenceRangeError``). See docs/data.md.
"""

from __future__ import annotations

from gradientmail.data.cache import CacheStats
from gradientmail.data.corpus import Corpus, build_stdlib_corpus, stdlib_files
from gradientmail.data.errors import FileChangedError, SequenceRangeError, ShardError, TokenFileError
from gradientmail.data.reader import TokenReader
from gradientmail.data.shard_cache import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CACHE_BYTES,
    DEFAULT_CACHE_DIR_BYTES,
    CachedFile,
    Pin,
    ShardCache,
)
from gradientmail.data.writer import TokenFileInfo, Tokenizer, text_files, write_tokens

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_CACHE_BYTES",
    "DEFAULT_CACHE_DIR_BYTES",
    "CacheStats",
    "CachedFile",
    "Corpus",
    "FileChangedError",
    "Pin",
    "SequenceRangeError",
    "ShardCache",
    "ShardError",
    "TokenFileError",
    "TokenFileInfo",
    "TokenReader",
    "Tokenizer",
    "build_stdlib_corpus",
    "stdlib_files",
    "text_files",
    "write_tokens",
]
