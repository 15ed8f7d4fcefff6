"""Real data for the shared queue: token files, several passes over units, mixtures of sources.

``TokenReader.sequences(start, count)`` reads a token file; ``write_tokens`` and ``text_files``
write one, ``build_stdlib_corpus`` builds one from the Python standard library, and
``gradientmail tokens`` does the same from the shell. ``epochs`` makes several seeded passes over
units one run, and ``mix`` interleaves several sources by weight. Everything read is untrusted
and checked (``TokenFileError``, ``SequenceRangeError``). See docs/data.md.
"""

from __future__ import annotations

from gradientmail.data.cache import CacheStats
from gradientmail.data.corpus import Corpus, build_stdlib_corpus, stdlib_files
from gradientmail.data.epochs import EpochUnit, epochs, permutation
from gradientmail.data.errors import SequenceRangeError, TokenFileError
from gradientmail.data.mix import SourceUnit, mix
from gradientmail.data.reader import DEFAULT_BLOCK_SIZE, DEFAULT_CACHE_BYTES, DEFAULT_CACHE_DIR_BYTES, TokenReader
from gradientmail.data.writer import TokenFileInfo, Tokenizer, text_files, write_tokens

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_CACHE_BYTES",
    "DEFAULT_CACHE_DIR_BYTES",
    "CacheStats",
    "Corpus",
    "EpochUnit",
    "SequenceRangeError",
    "SourceUnit",
    "TokenFileError",
    "TokenFileInfo",
    "TokenReader",
    "Tokenizer",
    "build_stdlib_corpus",
    "epochs",
    "mix",
    "permutation",
    "stdlib_files",
    "text_files",
    "write_tokens",
]
