"""Write a token file from text files: raw bytes as tokens (vocabulary 256) or your tokenizer.

``*.npy`` gets a numpy header, any other name is a raw ``.bin``; the file is written beside the
target and renamed into place, so no reader sees half a file. See docs/data.md.
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

    Args:
        sources: files and directories.
        suffixes: if given (e.g. ``[".py"]``), keep only files found in directories that end so.

    Raises:
        FileNotFoundError: a source is neither a file nor a directory.
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
    """Tokenize ``files`` in order into the token file ``out`` (``.npy`` by its name, else raw).

    Args:
        out: the file to write; its directory is created if needed.
        files: the documents, in order.
        tokenizer: text of one file to its token ids; without one each byte is a token
            (vocabulary 256, no decoding).
        dtype: ``"uint16"`` (ids below 65,536) or ``"uint32"``.
        eot: a token id appended after every file (a document separator; for bytes, 256 or more).
        encoding, errors: how files are decoded for ``tokenizer``.

    Returns:
        A ``TokenFileInfo``: the path, the token and document counts and the dtype.

    Raises:
        TokenFileError: no files, a bad ``dtype`` or ``eot``, undecodable text, or an id that
            does not fit ``dtype``.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from gradientmail.data import write_tokens
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     doc = Path(tmp, "doc.txt")
        ...     _ = doc.write_text("abc")
        ...     info = write_tokens(Path(tmp, "tokens.npy"), [doc, doc], eot=256)
        ...     (info.tokens, info.documents, info.dtype, info.path.name)
        (8, 2, 'uint16', 'tokens.npy')
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
    """Append the tokens of the file ``path`` (and ``eot``) to ``stream``; how many were written."""
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
