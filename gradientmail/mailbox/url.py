"""URLs: which backend serves a scheme (one table, shared with the CLI), mistyped ones refused, ``open_mailbox``.

Section ``registry`` below: The URL schemes ``open_mailbox`` serves: one table, shared with the CLI (as fsspec's registry).

Each scheme maps to a ``Backend``: how to open a URL of it, which extra it needs (with the
``pip install`` that fixes a missing one) and what a caller must know about it (whether other
processes can reach it, whether it takes an ``endpoint_url``). Backends are imported lazily, so
``import gradientmail`` pulls neither boto3 nor fsspec.

Section ``url_check`` below: Telling a local path from a URL, and refusing mistyped URLs before they become directories.

``s3:/bucket/run`` must not silently create a local directory ``s3:`` that no other node sees.
Which forms are refused, and why, is in docs/mailboxes.md.

Section ``url`` below: ``open_mailbox(url)``: pick a backend from a URL, the way fsspec picks a filesystem.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from gradientmail.errors import MissingExtraError, UnsafeStoreError
from gradientmail.mailbox.base import Mailbox

__all__ = [
    "Backend",
    "FSSPEC",
    "SCHEMES",
    "WEB",
    "WEB_SCHEMES",
    "backend_for",
    "is_local_path",
    "known_to_fsspec",
    "open_mailbox",
    "open_url",
    "register_backend",
    "served",
    "unregister_backend",
]


# -- registry ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Backend:
    """How ``open_mailbox`` serves the URLs of one scheme.

    Attributes:
        name: The backend class, for messages.
        open: ``open(url, rest, options)`` builds the mailbox; ``rest`` is the URL after ``://``.
        extra: The ``gradientmail[extra]`` it needs, or None.
        package: The package that extra installs (named in the install hint).
        shared: Whether other processes can reach the mailbox (False: ``memory://``).
        endpoint: Whether it takes an ``endpoint_url`` (S3-compatible stores).
        local: Whether it is a directory on this machine (takes ``create``).
        check: ``check(scheme, rest)`` -> ``(problem, meant)`` for a URL that names no usable
            place (``meant``: the URL likely intended, or None), None for a good one; run before
            anything is opened, so a mistyped URL never becomes a directory or a request.
    """

    name: str
    open: Callable[[str, str, dict[str, Any]], Mailbox]
    extra: str | None = None
    package: str = ""
    shared: bool = True
    endpoint: bool = False
    local: bool = False
    check: Callable[[str, str], tuple[str, str | None] | None] | None = None

    @property
    def install_hint(self) -> str:
        """The ``pip install`` that provides this backend's dependencies ('' when none)."""
        return f"pip install 'gradientmail[{self.extra}]'" if self.extra else ""

    def missing(self, url: str, exc: ImportError) -> MissingExtraError:
        """The error for a missing dependency of this backend, naming the install hint."""
        return MissingExtraError(f"{url}: {self.name} mailboxes need {self.package}: {self.install_hint} ({exc})")


def _open_file(url: str, rest: str, options: dict[str, Any]) -> Mailbox:
    from gradientmail.mailbox.local import LocalMailbox

    return LocalMailbox(unquote(urlsplit(url).path), **options)


def _open_memory(url: str, rest: str, options: dict[str, Any]) -> Mailbox:
    from gradientmail.mailbox.memory import MemoryMailbox

    if options:
        raise TypeError(f"memory:// mailboxes take no options, got {sorted(options)}")
    return MemoryMailbox(rest.strip("/") or "default")


def _open_s3(url: str, rest: str, options: dict[str, Any]) -> Mailbox:
    try:
        from gradientmail.mailbox.s3 import S3Mailbox
    except ImportError as exc:
        raise SCHEMES["s3"].missing(url, exc) from exc
    bucket, _, prefix = rest.partition("/")
    return S3Mailbox(bucket, prefix, **options)


def _open_web(url: str, rest: str, options: dict[str, Any]) -> Mailbox:
    raise _web_url_error(url, url.partition("://")[0].lower(), rest)


def _open_fsspec(url: str, rest: str, options: dict[str, Any]) -> Mailbox:
    try:
        from gradientmail.mailbox.filesystem import FsspecMailbox
    except ImportError as exc:
        raise FSSPEC.missing(url, exc) from exc
    return FsspecMailbox.from_url(url, **options)


def _check_file(scheme: str, rest: str) -> tuple[str, str | None] | None:
    host, _, path = rest.partition("/")
    if host.lower() not in ("", "localhost"):
        return (
            f"names the host {host!r}, which would be ignored: a file:// mailbox is a local "
            "directory (or one on a shared mount)",
            f"file:///{host}/{path}",
        )
    return ("names no directory", None) if not path.strip("/") else None


def _check_s3(scheme: str, rest: str) -> tuple[str, str | None] | None:
    if not rest.partition("/")[0]:
        return "names no bucket", f"{scheme}://{rest.lstrip('/')}" if rest.strip("/") else None
    return None


_S3 = Backend("S3", _open_s3, extra="s3", package="boto3", endpoint=True, check=_check_s3)

SCHEMES: dict[str, Backend] = {
    "file": Backend("LocalMailbox", _open_file, local=True, check=_check_file),
    "memory": Backend("MemoryMailbox", _open_memory, shared=False),
    "s3": _S3,
    "s3a": _S3,
}
"""Schemes served by GradientMail's own backends and registered ones (lower case): ``register_backend``."""

_SCHEME_NAME = re.compile(r"[a-z][a-z0-9+.-]*")


def register_backend(scheme: str, backend: Backend, *, replace: bool = False) -> None:
    """Serve ``scheme://`` URLs with ``backend``: in ``open_mailbox``, its mistyped-URL checks
    (``backend.check``) and the command line, which all read one table.

    Raises:
        ValueError: ``scheme`` is not a lower-case URL scheme, or is served already (``replace``
            to serve it with another backend).
        TypeError: ``backend`` is not a ``Backend``.

    Example:
        >>> from gradientmail.mailbox.memory import MemoryMailbox
        >>> def open_toy(url, rest, options):
        ...     return MemoryMailbox("toy-" + rest)
        >>> register_backend("toy", Backend("ToyMailbox", open_toy, shared=False))
        >>> open_mailbox("toy://run-1")
        MemoryMailbox('toy-run-1')
        >>> unregister_backend("toy")
    """
    if not isinstance(scheme, str) or not _SCHEME_NAME.fullmatch(scheme):
        raise ValueError(f"a backend's scheme must be a lower-case URL scheme like 'gs', not {scheme!r}")
    if not isinstance(backend, Backend):
        raise TypeError(f"register_backend takes a Backend, not {type(backend).__name__}")
    if scheme in SCHEMES and not replace:
        raise ValueError(f"the scheme {scheme!r} is served already by {SCHEMES[scheme].name} (pass replace=True)")
    SCHEMES[scheme] = backend


def unregister_backend(scheme: str) -> None:
    """Stop serving ``scheme://`` URLs (a test's clean-up); GradientMail's own schemes stay."""
    if scheme in ("file", "memory", "s3", "s3a"):
        raise ValueError(f"{scheme!r} is one of GradientMail's own schemes")
    SCHEMES.pop(scheme, None)


FSSPEC = Backend("fsspec", _open_fsspec, extra="fsspec", package="fsspec")
"""Any other protocol fsspec knows; ``FsspecMailbox`` refuses those without a verified atomic create."""

WEB_SCHEMES = ("http", "https")
"""Refused: a web server has no atomic create (an S3 store there is ``s3://`` + ``endpoint_url``)."""

WEB = Backend("web server", _open_web)
"""The backend of ``WEB_SCHEMES``: opening one raises ``UnsafeStoreError`` with the likely call."""


def known_to_fsspec(scheme: str) -> bool | None:
    """Whether fsspec knows the protocol ``scheme``; None when fsspec is not installed."""
    try:
        from fsspec.registry import known_implementations, registry
    except ImportError:
        return None
    return scheme in known_implementations or scheme in registry


def backend_for(scheme: str) -> Backend | None:
    """The backend serving ``scheme`` (any case), ``FSSPEC`` for other fsspec protocols, else None.

    Example:
        >>> from gradientmail.mailbox.url import backend_for
        >>> backend_for("S3").install_hint, backend_for("memory").shared
        ("pip install 'gradientmail[s3]'", False)
    """
    scheme = scheme.lower()
    if scheme in SCHEMES:
        return SCHEMES[scheme]
    if scheme in WEB_SCHEMES:
        return WEB
    return None if known_to_fsspec(scheme) is False else FSSPEC  # fsspec missing: opening names the extra


def open_url(url: str, **options: Any) -> Mailbox:
    """Open ``url`` (``scheme://rest``) with the backend its scheme maps to.

    Raises:
        UnsafeStoreError: an ``http(s)://`` URL; the message shows the ``s3://`` call likely meant.
        MissingExtraError: the backend's dependency is not installed.
    """
    scheme, _, rest = url.partition("://")
    return (backend_for(scheme) or FSSPEC).open(url, rest, options)


def _web_url_error(url: str, scheme: str, rest: str) -> UnsafeStoreError:
    """Why an ``http(s)://`` URL is no mailbox, and the ``s3://`` call that was likely meant."""
    host, _, path = rest.partition("/")
    bucket, _, prefix = path.strip("/").partition("/")
    target = f"s3://{bucket or 'BUCKET'}/{prefix or 'PREFIX'}"
    return UnsafeStoreError(
        f"{url}: cannot use an {scheme}:// URL as a mailbox: GradientMail has not verified an "
        "atomic create for a web server (fsspec's HTTPFileSystem has none), so two nodes could "
        "claim the same unit. For an S3-compatible store at this address use "
        f"open_mailbox({target!r}, endpoint_url={f'{scheme}://{host}'!r})",
        operation="open",
        store=url,
    )


# -- url_check ---------------------------------------------------------------------------------------

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


# -- url ---------------------------------------------------------------------------------------------


def open_mailbox(url: str | os.PathLike[str], **options: Any) -> Mailbox:
    """Open the mailbox at ``url``; the scheme (any case) picks the backend (``registry``).

    A path or ``file:///path`` is a ``LocalMailbox``, ``memory://name`` a ``MemoryMailbox``,
    ``s3://bucket/prefix`` an ``S3Mailbox`` and any other fsspec protocol an ``FsspecMailbox``
    (refused unless its atomic create is verified). Mistyped URLs (``s3:/bucket``,
    ``file://host/run``, an unknown scheme) are refused, never turned into a local directory.

    Args:
        url: A path or URL.
        **options: For the backend: ``create=False`` (local), ``endpoint_url``, ``region_name``,
            ``retry_window``... (S3), storage options (fsspec).

    Returns:
        A mailbox that follows the ``Mailbox`` protocol.

    Raises:
        ValueError: a mistyped or unknown URL; the message shows the likely intended one.
        UnsafeStoreError: a store without an atomic create (``http(s)://``, unverified fsspec).
        MissingExtraError: the backend's extra is not installed; the message names the pip install.

    Example:
        >>> from gradientmail.mailbox import open_mailbox
        >>> box = open_mailbox("memory://doctest-open")
        >>> box
        MemoryMailbox('doctest-open')
        >>> box.put_if_absent("hello", b"world"), box.get("hello")
        (True, b'world')
        >>> open_mailbox("s3:/bucket/run")
        Traceback (most recent call last):
        ...
        ValueError: mailbox URL 's3:/bucket/run' is missing the '//' after 's3:': did you mean 's3://bucket/run'? For a local directory of that name, pass an absolute path or a str starting with './'.
    """
    path_like = isinstance(url, os.PathLike)
    if path_like:
        url = os.fspath(url)
    if not isinstance(url, str) or not url:
        raise ValueError(f"mailbox URL must be a non-empty str or path, not {url!r}")
    if is_local_path(url, path_like=path_like):  # refuses mistyped URLs (ValueError)
        from gradientmail.mailbox.local import LocalMailbox

        # "~/runs/x" is the user's home, as in a shell, not a directory named "~" here.
        return LocalMailbox(os.path.expanduser(url), **options)
    return open_url(url, **options)
