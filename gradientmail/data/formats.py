"""Where the tokens of a file are: a raw ``.bin`` (nanoGPT-style) or a ``.npy`` array.

A raw file cannot say its dtype (``uint16`` unless told); a ``.npy`` header is parsed without
numpy (a bounded ``ast.literal_eval``, every field checked), since numpy is no dependency.
"""

from __future__ import annotations

import ast
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from gradientmail.data.errors import TokenFileError
from gradientmail.errors import short_repr

FileFormat = Literal["auto", "bin", "npy"]

DTYPES: dict[str, int] = {"uint16": 2, "uint32": 4}
"""Supported token dtypes and their sizes in bytes."""

NPY_DESCR = {"<u2": "uint16", "<u4": "uint32"}
NPY_MAGIC = b"\x93NUMPY"
MAX_NPY_HEADER = 64 * 1024
MAX_TOKENS = 2**62
"""More tokens than any file holds (8 EiB of uint16): a header that says more is refused."""
"""Longest ``.npy`` header accepted (numpy writes about 128 bytes)."""

NPY_HEADER_BYTES = 128
"""Total header size this package writes (magic to newline), room for any 1-D length."""


@dataclass(frozen=True)
class TokenLayout:
    """Where the tokens are: ``tokens`` tokens of ``dtype`` from byte ``offset`` on."""

    format: Literal["bin", "npy"]
    dtype: str
    offset: int
    tokens: int

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype]


def dtype_name(dtype: object) -> str:
    """``"uint16"`` or ``"uint32"`` from a name, a numpy dtype or a torch dtype.

    Raises:
        TokenFileError: any other dtype.

    Example:
        >>> dtype_name("<u4")
        'uint32'
    """
    name = str(dtype).removeprefix("torch.").lower()
    name = {"u2": "uint16", "<u2": "uint16", "u4": "uint32", "<u4": "uint32"}.get(name, name)
    if name not in DTYPES:
        raise TokenFileError(f"unsupported token dtype {dtype!r}: use 'uint16' (vocabularies up to 65,536) or 'uint32'")
    return name


def resolve_format(name: str, format: FileFormat) -> Literal["bin", "npy"]:
    """``format``, or for ``"auto"`` the one the file ``name`` suggests (``.npy``, else raw).

    Raises:
        TokenFileError: ``format`` is none of ``"auto"``, ``"bin"``, ``"npy"``.
    """
    if format == "auto":
        return "npy" if name.lower().endswith(".npy") else "bin"
    if format not in ("bin", "npy"):
        raise TokenFileError(f"format must be 'auto', 'bin' or 'npy', not {format!r}")
    return format


def read_layout(
    name: str,
    size: int,
    read: Callable[[int, int], bytes],
    *,
    format: FileFormat = "auto",
    dtype: object | None = None,
) -> TokenLayout:
    """Where the tokens of one file are, from its size and (for ``.npy``) its header.

    Args:
        name: the file's name or URL, for its format and for messages.
        size: the file's size in bytes.
        read: ``read(start, stop)`` reads bytes ``[start, stop)`` of the file.
        format: ``"auto"`` (by the name's suffix), ``"bin"`` or ``"npy"``.
        dtype: the token dtype asked for, or None (a raw file is then ``uint16``).

    Raises:
        TokenFileError: the file is not a usable token file of that format and dtype.
    """
    kind = resolve_format(name, format)
    wanted = dtype_name(dtype) if dtype is not None else None
    if kind == "npy":
        layout = _npy_layout(name, size, read)
        if wanted is not None and wanted != layout.dtype:
            raise TokenFileError(f"{name}: the .npy header says {layout.dtype}, but dtype={wanted!r} was asked for")
        return layout
    chosen = wanted or "uint16"
    if size >= len(NPY_MAGIC) and format == "auto" and read(0, len(NPY_MAGIC)) == NPY_MAGIC:
        raise TokenFileError(
            f"{name}: starts with the .npy magic bytes but is read as raw tokens; name it "
            "*.npy or pass format='npy' (format='bin' to read it raw anyway)"
        )
    itemsize = DTYPES[chosen]
    if size % itemsize:
        raise TokenFileError(
            f"{name}: {size:,} bytes is not a whole number of {chosen} tokens ({itemsize} bytes "
            "each): a truncated upload, or another dtype?"
        )
    return TokenLayout("bin", chosen, 0, size // itemsize)


def _npy_layout(name: str, size: int, read: Callable[[int, int], bytes]) -> TokenLayout:
    if size < 10:
        raise TokenFileError(f"{name}: {size} bytes is too short for a .npy file")
    start = read(0, min(size, 12))
    if start[:6] != NPY_MAGIC:
        raise TokenFileError(f"{name}: not a .npy file (no \\x93NUMPY magic at the start)")
    major = start[6]
    if major == 1:
        (length,), offset = struct.unpack("<H", start[8:10]), 10
    elif major in (2, 3) and len(start) >= 12:
        (length,), offset = struct.unpack("<I", start[8:12]), 12
    else:
        raise TokenFileError(f"{name}: unsupported .npy format version {major}.{start[7]}")
    if length > MAX_NPY_HEADER or offset + length > size:
        raise TokenFileError(
            f"{name}: .npy header of {length:,} bytes (file {size:,} bytes, at most {MAX_NPY_HEADER:,} accepted)"
        )
    raw = read(offset, offset + length)
    try:
        header = ast.literal_eval(raw.decode("latin-1"))
    except (ValueError, SyntaxError, MemoryError, RecursionError) as exc:
        raise TokenFileError(f"{name}: unreadable .npy header ({exc})") from None
    descr, shape = _npy_fields(name, header)
    tokens = math.prod(shape)
    data_start = offset + length
    expected = data_start + tokens * DTYPES[NPY_DESCR[descr]]
    if size != expected:
        what = "truncated" if size < expected else "longer than its header says"
        raise TokenFileError(
            f"{name}: {what}: the header says {tokens:,} tokens of {NPY_DESCR[descr]} "
            f"({expected:,} bytes with the header), the file has {size:,} bytes"
        )
    return TokenLayout("npy", NPY_DESCR[descr], data_start, tokens)


def _npy_fields(name: str, header: Any) -> tuple[str, tuple[int, ...]]:
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        raise TokenFileError(f"{name}: a .npy header must be a dict of descr, fortran_order, shape")
    descr, shape = header["descr"], header["shape"]
    if descr not in NPY_DESCR:
        hint = " (big-endian; save it little-endian)" if str(descr).startswith(">") else ""
        raise TokenFileError(f"{name}: .npy dtype {short_repr(descr)}{hint} is not a token dtype: use uint16 or uint32")
    if header["fortran_order"] is not False:
        raise TokenFileError(f"{name}: a Fortran-order .npy is not a flat file of tokens")
    if not isinstance(shape, tuple) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise TokenFileError(f"{name}: .npy shape {short_repr(shape)} is not a tuple of sizes")
    if math.prod(shape) > MAX_TOKENS:
        raise TokenFileError(f"{name}: .npy shape {short_repr(shape)} holds more tokens than any file can")
    return descr, shape


def npy_header(dtype: str, tokens: int) -> bytes:
    """A version 1.0 ``.npy`` header of exactly ``NPY_HEADER_BYTES`` for ``tokens`` tokens."""
    descr = {v: k for k, v in NPY_DESCR.items()}[dtype_name(dtype)]
    text = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': ({tokens},), }}"
    length = NPY_HEADER_BYTES - 10
    return NPY_MAGIC + b"\x01\x00" + struct.pack("<H", length) + text.ljust(length - 1).encode() + b"\n"
