"""Telling a local path from a URL, and refusing mistyped URLs before they become directories.

``s3:/bucket/run`` must not silently create a local directory ``s3:`` that no other node sees.
Which forms are refused, and why, is in docs/mailboxes.md.
"""

from __future__ import annotations

import difflib
import re

from gradientmail.mailbox.schemes import SCHEMES, known_to_fsspec

__all__ = [
    "is_local_path",
    "served",
]


_OTHER_STORES = ("gs", "gcs", "az", "abfs", "abfss", "adl", "http", "https")


def served() -> tuple[str, ...]:
    """The schemes ``open_mailbox`` maps to a backend of its table (registered ones included)."""
    return tuple(SCHEMES)


def _lookalike() -> tuple[str, ...]:
    """Schemes whose ``scheme:...`` form (without ``//``) is surely a mistyped URL."""
    return served() + _OTHER_STORES


def _served_words() -> str:
    return ", ".join(f"{scheme}://" for scheme in served() if scheme != "s3a") + " and verified fsspec protocols"


_SCHEME = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*):(?P<rest>.*)", re.DOTALL)


def _suggest(scheme: str, rest: str) -> str:
    """The URL most likely meant by ``scheme`` and the text after it."""
    body = rest.lstrip("/")
    if scheme == "file":
        return f"file:///{body}"
    if scheme in ("s3", "s3a", "gs", "gcs"):
        return f"{scheme}://{body or 'bucket/prefix'}"
    return f"{scheme}://{body}"


def _refuse(url: str, problem: str, meant: str | None, *, path_like: bool | None = None) -> ValueError:
    """The refusal; ``path_like`` not None: ``url`` could also be read as a local path."""
    message = f"mailbox URL {url!r} {problem}" + (f": did you mean {meant!r}?" if meant else ".")
    if path_like:
        message += " (pathlib collapses '//': pass a URL as a str.)"
    if path_like is not None:
        message += " For a local directory of that name, pass an absolute path or a str starting with './'."
    return ValueError(message)


def is_local_path(url: str, *, path_like: bool = False) -> bool:
    """True when ``url`` names a local directory, False for a URL ``open_mailbox`` may serve.

    Args:
        url: what the user passed (schemes are case-insensitive).
        path_like: ``url`` came from an ``os.PathLike`` (a ``Path`` turns ``s3://b`` into
            ``s3:/b``), which the message then mentions.

    Raises:
        ValueError: ``url`` looks like a URL but is not one ``open_mailbox`` serves (a known
            scheme without ``//``, ``file://`` with a host, ``s3:///b``, an unknown scheme); the
            message names the likely intended URL.

    Example:
        >>> is_local_path("runs/exp-7"), is_local_path("run:7"), is_local_path("S3://bucket/run")
        (True, True, False)
        >>> is_local_path("s3:/bucket/run")
        Traceback (most recent call last):
        ...
        ValueError: mailbox URL 's3:/bucket/run' is missing the '//' after 's3:': did you mean 's3://bucket/run'? ...
    """
    if url.startswith("/"):
        return True
    scheme, sep, rest = url.partition("://")
    if sep and _SCHEME.fullmatch(f"{scheme}:"):
        _check_url(url, scheme.lower(), rest)
        return False
    if sep:
        return True  # "./a://b": a path that happens to contain "://"
    first = url.partition("/")[0]
    if first.lower() in served() and url[len(first) :].startswith("//"):
        meant = f"{first.lower()}:{url[len(first) :]}"
        raise _refuse(url, "lacks the ':' after its scheme", meant, path_like=path_like)
    match = _SCHEME.fullmatch(url)
    if not match:
        return True
    scheme, rest = match["scheme"].lower(), match["rest"]
    if scheme in _lookalike():
        raise _refuse(
            url,
            f"is missing the '//' after '{match['scheme']}:'",
            _suggest(scheme, rest),
            path_like=path_like,
        )
    if rest.startswith("/"):
        close = difflib.get_close_matches(scheme, served(), n=1, cutoff=0.5)
        raise _refuse(
            url,
            f"looks like a URL with the unknown scheme {scheme!r} (open_mailbox serves {_served_words()})",
            _suggest(close[0], rest) if close else None,
            path_like=path_like,
        )
    return True  # "run:7/x": a relative path whose first name contains a colon


def _check_url(url: str, scheme: str, rest: str) -> None:
    """Refuse a ``scheme://rest`` URL that names no usable place (see ``is_local_path``)."""
    backend = SCHEMES.get(scheme)
    if backend is not None:
        problem = backend.check(scheme, rest) if backend.check is not None else None
        if problem is not None:
            raise _refuse(url, *problem)
        return
    if known_to_fsspec(scheme) is False:
        close = difflib.get_close_matches(scheme, served(), n=1, cutoff=0.5)
        raise _refuse(
            url,
            f"has the protocol {scheme!r}, which is not known to open_mailbox or fsspec (served: {_served_words()})",
            _suggest(close[0], rest) if close else None,
        )
