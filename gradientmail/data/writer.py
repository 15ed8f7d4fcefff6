"""Write a token file from text files: raw bytes as tokens (vocabulary 256) or your tokenizer.

The output is what ``TokenReader`` reads: ``*.npy`` gets a numpy header (it records the dtype),
any other name is a raw nanoGPT-style ``.bin``. It is written to a temporary file beside the
target and renamed into place, so a reader (or another process building the same file) never
sees half a file.
"""

from __future__ import annotations

import contextlib
import operator
import os
import sys
import tempfile
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from gradientmail.data.errors import TokenFileError
from gradientmail.data.formats import DTYPES, NPY_HEADER_BYTES, dtype_name, npy_header

Tokenizer = Callable[[str], Sequence[int]]
"""Text of one document → its token ids (e.g. ``tiktoken.get_encoding("gpt2").encode_ordinary``)."""

_ARRAY_CODE = {"uint16": "H", "uint32": "I" if array("I").itemsize == 4 else "L"}


@dataclass(frozen=True)
class TokenFileInfo:
    """What ``write_tokens`` wrote: ``tokens`` tokens of ``dtype`` from ``documents`` files."""

    path: Path
    tokens: int
    documents: int
    dtype: str


def text_files(sources: Iterable[str | os.PathLike[str]], *, suffixes: Sequence[str] = ()) -> list[Path]:
    """Files named by ``sources``: files as given, directories walked (sorted, no hidden entries).

    ``suffixes`` (e.g. ``[".py"]``) filters the files found in directories.
    """
    found: list[Path] = []
    for source in sources:
        path = Path(source)
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            for root, dirs, files in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                found.extend(
                    Path(root, name)
                    for name in sorted(files)
                    if not name.startswith(".") and (not suffixes or name.endswith(tuple(suffixes)))
                )
        else:
            raise FileNotFoundError(f"no file or directory at {path}")
    return found


def write_tokens(
    out: str | os.PathLike[str],
    files: Iterable[str | os.PathLike[str]],
    *,
    tokenizer: Tokenizer | None = None,
    dtype: str = "uint16",
    eot: int | None = None,
    encoding: str = "utf-8",
    errors: str = "strict",
) -> TokenFileInfo:
    """Tokenize ``files`` in order into the token file ``out``.

    Without ``tokenizer`` each byte of a file is a token (vocabulary 256, no decoding); with
    one, each file is decoded (``encoding``, ``errors``) and passed to it whole. ``eot``, if
    given, is appended after every file (a document separator; outside 0-255 for bytes).
    Token ids must fit ``dtype`` (``uint16``: below 65,536; else pass ``dtype="uint32"``).
    """
    dtype = dtype_name(dtype)
    limit = 1 << (8 * DTYPES[dtype])
    if eot is not None and (isinstance(eot, bool) or not isinstance(eot, int) or not 0 <= eot < limit):
        raise TokenFileError(f"eot must be a token id in [0, {limit:,}) for {dtype}, not {eot!r}")
    out = Path(out)
    npy = out.suffix.lower() == ".npy"
    out.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    tokens = documents = 0
    try:
        with os.fdopen(handle, "wb") as stream:
            if npy:
                stream.write(b"\0" * NPY_HEADER_BYTES)  # rewritten once the length is known
            for path in files:
                tokens += _write_document(stream, Path(path), tokenizer, dtype, eot, encoding, errors)
                documents += 1
            if documents == 0:
                raise TokenFileError(f"{out}: no input files to tokenize")
            if npy:
                stream.seek(0)
                stream.write(npy_header(dtype, tokens))
        os.chmod(temporary, 0o644)  # mkstemp's 0600 would hide the file from other users
        os.replace(temporary, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return TokenFileInfo(out, tokens, documents, dtype)


def _write_document(
    stream: BinaryIO, path: Path, tokenizer: Tokenizer | None, dtype: str, eot: int | None, encoding: str, errors: str
) -> int:
    data = path.read_bytes()
    if tokenizer is None:
        width = DTYPES[dtype]
        packed = bytearray(len(data) * width)
        packed[0::width] = data  # little-endian: the byte, then zeros
        stream.write(packed)
        count = len(data)
    else:
        try:
            text = data.decode(encoding, errors)
        except UnicodeDecodeError as exc:
            raise TokenFileError(
                f"{path}: not {encoding} text ({exc.reason} at byte {exc.start}); pass "
                "errors='replace' to tokenize it anyway"
            ) from None
        ids = tokenizer(text)
        ids = list(ids.tolist() if hasattr(ids, "tolist") else ids)  # numpy / torch arrays too
        try:
            values = array(_ARRAY_CODE[dtype], ids)
        except (OverflowError, TypeError) as exc:
            bad = next((t for t in ids if not _is_token(t, 1 << (8 * DTYPES[dtype]))), None)
            hint = " (pass dtype='uint32')" if isinstance(bad, int) and bad > 0 else ""
            raise TokenFileError(
                f"{path}: the tokenizer returned {bad!r}, not a {dtype} token id{hint} ({exc})"
            ) from None
        if sys.byteorder != "little":  # pragma: no cover
            values.byteswap()
        stream.write(values.tobytes())
        count = len(values)
    if eot is not None:
        stream.write(eot.to_bytes(DTYPES[dtype], "little"))
        count += 1
    return count


def _is_token(value: object, limit: int) -> bool:
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        return False
    return 0 <= operator.index(value) < limit
