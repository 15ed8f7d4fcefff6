"""Real data for the shared queue: a token reader giving the seed's ``sequences(start, count)``.

::

    from gradientmail.data import TokenReader, build_stdlib_corpus

    corpus = build_stdlib_corpus("data/stdlib")          # train.bin + val.bin, bytes as tokens
    reader = TokenReader(corpus.train, seq_len=256)       # or "s3://bucket/train.bin"
    batch = reader.sequences(start, count)                # int64, (count, 257)
    x, y = batch[:, :-1], batch[:, 1:]

- ``TokenReader``: a flat file of ``uint16``/``uint32`` tokens (raw ``.bin`` or ``.npy``) on
  local disk or any fsspec URL, read in ranged requests through a bounded block cache;
  picklable into DataLoader workers (each reopens the file and has its own cache).
- ``write_tokens``, ``text_files``: write such a file from text files (bytes, or a tokenizer).
- ``build_stdlib_corpus``: the Python standard library's ``.py`` files, split train/validation.
- ``gradientmail tokens write|stdlib`` (or ``python -m gradientmail.data``): the same, bytes only.

Everything read from a file is untrusted: sizes, headers and (with ``vocab_size``) token values
are checked, and errors (``TokenFileError``, ``SequenceRangeError``) name the file and the value.
"""

from __future__ import annotations

from gradientmail.data.cache import CacheStats
from gradientmail.data.corpus import Corpus, build_stdlib_corpus, stdlib_files
from gradientmail.data.errors import SequenceRangeError, TokenFileError
from gradientmail.data.reader import DEFAULT_BLOCK_SIZE, DEFAULT_CACHE_BYTES, TokenReader
from gradientmail.data.writer import TokenFileInfo, Tokenizer, text_files, write_tokens

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_CACHE_BYTES",
    "CacheStats",
    "Corpus",
    "SequenceRangeError",
    "TokenFileError",
    "TokenFileInfo",
    "TokenReader",
    "Tokenizer",
    "build_stdlib_corpus",
    "stdlib_files",
    "text_files",
    "write_tokens",
]
