"""The standard-library corpus: every ``.py`` file of the running Python, no download needed.

Validation files are chosen by a hash of their path, so the split is the same on every machine
with the same Python; a build whose manifest matches is reused. See docs/data.md.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

from gradientmail.data.formats import DTYPES, dtype_name
from gradientmail.data.writer import Tokenizer, text_files, write_tokens

TRAIN_FILE = "train.bin"
VALIDATION_FILE = "val.bin"
MANIFEST = "manifest.json"
MAX_MANIFEST = 64 * 1024
EXCLUDED = ("site-packages", "dist-packages")
"""Third-party packages installed inside the standard library's directory."""


@dataclass(frozen=True)
class Corpus:
    """The two token files of a corpus and their sizes."""

    train: Path
    validation: Path
    train_tokens: int
    validation_tokens: int
    files: int
    vocab_size: int | None
    """256 for bytes; ``None`` for a tokenizer (its vocabulary is the tokenizer's business)."""


def stdlib_files(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """The ``.py`` files of the standard library, sorted, without installed third-party packages.

    Args:
        root: the standard library's directory (default: this Python's).

    Raises:
        FileNotFoundError: there is no ``.py`` file under ``root``.
    """
    base = Path(root or sysconfig.get_path("stdlib"))
    files = [path for path in text_files([base], suffixes=[".py"]) if path.relative_to(base).parts[0] not in EXCLUDED]
    if not files:
        raise FileNotFoundError(f"no .py files under {base}: is this the standard library?")
    return files


def is_validation(relative: str, fraction: float) -> bool:
    """Whether the file at ``relative`` (a POSIX path) is held out, for a ``fraction`` of files."""
    return zlib.crc32(relative.encode()) % 10_000 < round(fraction * 10_000)


def build_stdlib_corpus(
    out_dir: str | os.PathLike[str],
    *,
    validation: float = 0.05,
    tokenizer: Tokenizer | None = None,
    dtype: str = "uint16",
    eot: int | None = None,
    root: str | os.PathLike[str] | None = None,
    rebuild: bool = False,
) -> Corpus:
    """Write ``train.bin`` and ``val.bin`` under ``out_dir`` from the standard library's files.

    Args:
        out_dir: the directory to write (created if needed).
        validation: the fraction of files held out for ``val.bin``.
        tokenizer: text to token ids; without one, bytes are tokens. Files are then decoded as
            UTF-8 with replacement (a few standard-library test files are in other encodings).
        dtype: ``"uint16"`` or ``"uint32"``.
        eot: a token id appended after every file, if given.
        root: the standard library's directory (default: this Python's).
        rebuild: write again even when a matching bytes build is there.

    Returns:
        The ``Corpus``: both paths, their token counts, the file count and the vocabulary size.

    Raises:
        ValueError: ``validation`` is not a fraction, or it leaves a split empty.
        TokenFileError: an unsupported ``dtype``, ``eot`` or token id.
    """
    if not (isinstance(validation, float | int) and 0 < validation < 1):
        raise ValueError(f"validation must be a fraction between 0 and 1, not {validation!r}")
    dtype = dtype_name(dtype)
    out = Path(out_dir)
    base = Path(root or sysconfig.get_path("stdlib"))
    options = {"python": sys.version, "root": str(base), "validation": validation, "dtype": dtype, "eot": eot}
    if tokenizer is None and not rebuild and (found := _reuse(out, options)) is not None:
        return found
    files = stdlib_files(base)
    held = [is_validation(path.relative_to(base).as_posix(), validation) for path in files]
    train = [path for path, h in zip(files, held, strict=True) if not h]
    val = [path for path, h in zip(files, held, strict=True) if h]
    if not train or not val:
        raise ValueError(f"validation={validation} leaves an empty split of {len(files)} files")
    kwargs = {"tokenizer": tokenizer, "dtype": dtype, "eot": eot, "errors": "replace"}
    train_info = write_tokens(out / TRAIN_FILE, train, **kwargs)
    val_info = write_tokens(out / VALIDATION_FILE, val, **kwargs)
    corpus = Corpus(
        train_info.path,
        val_info.path,
        train_info.tokens,
        val_info.tokens,
        len(files),
        _byte_vocab(eot) if tokenizer is None else None,
    )
    if tokenizer is None:
        manifest = {
            **options,
            "train_tokens": corpus.train_tokens,
            "validation_tokens": corpus.validation_tokens,
            "files": corpus.files,
        }
        temporary = out / f".{MANIFEST}.{os.getpid()}.tmp"
        temporary.write_text(json.dumps(manifest, indent=1))
        os.replace(temporary, out / MANIFEST)
    return corpus


def _reuse(out: Path, options: dict[str, object]) -> Corpus | None:
    """The corpus already in ``out`` if its manifest and file sizes match ``options``."""
    try:
        with open(out / MANIFEST, "rb") as stream:
            raw = stream.read(MAX_MANIFEST + 1)
        if len(raw) > MAX_MANIFEST:
            return None
        manifest = json.loads(raw)
        if not isinstance(manifest, dict) or any(manifest.get(k) != v for k, v in options.items()):
            return None
        train, val, files = (manifest.get(k) for k in ("train_tokens", "validation_tokens", "files"))
        if not all(isinstance(n, int) and n > 0 for n in (train, val, files)):
            return None
        itemsize = DTYPES[dtype_name(options["dtype"])]
        if (
            os.path.getsize(out / TRAIN_FILE) != train * itemsize
            or os.path.getsize(out / VALIDATION_FILE) != val * itemsize
        ):
            return None
    except (OSError, ValueError):
        return None
    return Corpus(out / TRAIN_FILE, out / VALIDATION_FILE, train, val, files, _byte_vocab(options["eot"]))  # type: ignore[arg-type]


def _byte_vocab(eot: int | None) -> int:
    return 256 if eot is None else max(256, eot + 1)
