"""``gradientmail tokens``: token files from text (bytes as tokens) and the stdlib corpus.

Bytes only: a tokenizer is a Python callable, so pass it to ``write_tokens`` or
``build_stdlib_corpus``. ``python -m gradientmail.data`` runs the same actions.

``gradientmail.data`` (which imports torch) is imported only when a ``tokens`` action runs:
every command builds this parser, and ``status`` should not pay 2 s and 200 MB for torch.
"""

from __future__ import annotations

import argparse
from typing import Any

DTYPE_NAMES = ("uint16", "uint32")
"""``gradientmail.data.formats.DTYPES``, named here so building the parser imports no torch."""


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, not {text}")
    return value


def _dtype(text: str) -> str:
    from gradientmail.data.formats import DTYPES

    if text not in DTYPES:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(sorted(DTYPES))})")
    return text


def add_tokens_command(commands: Any) -> argparse.ArgumentParser:
    """Add ``tokens write`` and ``tokens stdlib`` to an ``add_subparsers()`` object."""
    tokens = commands.add_parser(
        "tokens",
        help="write token files for gradientmail.data.TokenReader (bytes as tokens)",
        description="Write flat token files (raw .bin, or .npy by the name) from text files.",
    )
    actions = tokens.add_subparsers(dest="tokens_command", metavar="ACTION")
    tokens.set_defaults(func=lambda args: (tokens.print_help(), 2)[1])

    write = actions.add_parser(
        "write",
        help="tokenize files and directories, one byte = one token (vocabulary 256)",
        description="Each byte of each file is a token; directories are walked in sorted order.",
    )
    write.add_argument("out", metavar="OUT", help="output file: *.npy for numpy, else raw .bin")
    write.add_argument("sources", nargs="+", metavar="FILE_OR_DIR")
    write.add_argument(
        "--suffix",
        action="append",
        default=[],
        metavar=".EXT",
        help="in directories, only files ending so (repeatable; default: all)",
    )
    write.add_argument("--dtype", type=_dtype, default="uint16", metavar="{" + ",".join(DTYPE_NAMES) + "}")
    write.add_argument("--eot", type=int, default=None, metavar="ID", help="token appended after each file (e.g. 256)")
    write.set_defaults(func=_cmd_write)

    stdlib = actions.add_parser(
        "stdlib",
        help="the Python standard library's .py files as train.bin and val.bin",
        description="Byte tokens of every .py file of this Python's standard library, with "
        "a validation split held out by file.",
    )
    stdlib.add_argument("out_dir", metavar="OUT_DIR")
    stdlib.add_argument(
        "--validation",
        type=_fraction,
        default=0.05,
        metavar="FRACTION",
        help="fraction of files held out (default 0.05)",
    )
    stdlib.add_argument("--rebuild", action="store_true", help="rebuild even if up to date")
    stdlib.set_defaults(func=_cmd_stdlib)
    return tokens


def _cmd_write(args: argparse.Namespace) -> int:
    from gradientmail.data.writer import text_files, write_tokens

    files = text_files(args.sources, suffixes=args.suffix)
    info = write_tokens(args.out, files, dtype=args.dtype, eot=args.eot)
    print(f"{info.path}: {info.tokens:,} {info.dtype} tokens from {info.documents:,} files")
    return 0


def _cmd_stdlib(args: argparse.Namespace) -> int:
    from gradientmail.data.corpus import build_stdlib_corpus

    corpus = build_stdlib_corpus(args.out_dir, validation=args.validation, rebuild=args.rebuild)
    print(f"{corpus.train}: {corpus.train_tokens:,} tokens")
    print(
        f"{corpus.validation}: {corpus.validation_tokens:,} tokens "
        f"({corpus.files:,} files, vocabulary {corpus.vocab_size})"
    )
    return 0
