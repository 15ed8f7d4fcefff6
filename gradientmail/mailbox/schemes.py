"""The URL schemes ``open_mailbox`` serves: one table, shared with the CLI (as fsspec's registry).

Each scheme maps to a ``Backend``: how to open a URL of it, which extra it needs (with the
``pip install`` that fixes a missing one) and what a caller must know about it (whether other
processes can reach it, whether it takes an ``endpoint_url``). Backends are imported lazily, so
``import gradientmail`` pulls neither boto3 nor fsspec.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from gradientmail.errors import MissingExtraError, UnsafeStoreError
from gradientmail.mailbox.base import Mailbox

__all__ = [
    "Backend",
    "backend_for",
    "FSSPEC",
    "known_to_fsspec",
    "open_url",
    "register_backend",
    "SCHEMES",
    "unregister_backend",
    "WEB",
    "WEB_SCHEMES",
]


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
        >>> from gradientmail.mailbox.url import open_mailbox
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
        >>> from gradientmail.mailbox.schemes import backend_for
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
