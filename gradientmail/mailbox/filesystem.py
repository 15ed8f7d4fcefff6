"""``FsspecMailbox``: a mailbox on an fsspec filesystem whose atomic create is verified.

fsspec's generic ``pipe_file(mode="create")`` checks and then writes, so two nodes could both win
a claim: only the filesystems in ``ATOMIC_CREATE`` are accepted, every other one is refused with
``UnsafeStoreError`` before anything is written. Local disk publishes a whole temporary file with
``os.link`` (as ``LocalMailbox``); s3fs >= 2025.7 sends ``If-None-Match: *`` with ``open(path,
"xb")`` and settles its own hidden retries with a metadata token. Details: docs/mailboxes.md.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
import fsspec.core
from fsspec.core import split_protocol
from fsspec.implementations.local import make_path_posix

from gradientmail.errors import MailboxError, MissingExtraError, UnsafeStoreError
from gradientmail.mailbox.base import BaseMailbox
from gradientmail.mailbox.keys import validate_prefix
from gradientmail.mailbox.local import LocalMailbox
from gradientmail.mailbox.s3_common import CREDENTIAL_CODES, EMPTY_RANGE_CODE, TOKEN_METADATA, error_code, list_keys

__all__ = ["ATOMIC_CREATE", "MIN_S3FS_VERSION", "FsspecMailbox"]

MIN_S3FS_VERSION = (2025, 7)
"""The first s3fs that sends ``If-None-Match: *`` with ``"xb"`` writes."""

ATOMIC_CREATE = {
    "fsspec.implementations.local.LocalFileSystem": "temporary file + os.link",
    "s3fs.core.S3FileSystem": "open(path, 'xb'): If-None-Match: * at commit (s3fs >= 2025.7)",
}
"""Filesystem classes (exact, not subclasses) whose atomic create is verified, and how."""

_UNVERIFIED = {
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "gcsfs": "gcsfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "az": "adlfs",
    "adl": "adlfs",
}
"""Protocols said to create atomically with ``"xb"`` but not verified here yet."""


def _class_path(fs: Any) -> str:
    return f"{type(fs).__module__}.{type(fs).__qualname__}"


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = getattr(fs, "protocol", ())
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _refusal(protocols: tuple[str, ...], name: str, where: str) -> UnsafeStoreError:
    if "memory" in protocols:
        why = (
            "an fsspec memory filesystem lives inside one process, so other nodes and worker "
            "processes would each see a private copy. Use open_mailbox('memory://name') for an "
            "in-process MemoryMailbox, or a directory / S3 for several processes"
        )
    elif any(p in _UNVERIFIED for p in protocols):
        package = next(_UNVERIFIED[p] for p in protocols if p in _UNVERIFIED)
        why = (
            f"{package} documents an atomic create (open(path, 'xb')), but GradientMail has not "
            "verified it yet, and a claim store must be proven atomic. Use S3 (s3://) or a "
            "shared directory for now"
        )
    else:
        why = (
            "GradientMail has not verified an atomic create for it. fsspec's generic "
            "pipe_file(mode='create') checks and then writes, so two nodes could both win one "
            "claim, and reading a claim back cannot compensate for a non-atomic store. Verified: "
            "local directories and s3fs >= 2025.7"
        )
    return UnsafeStoreError(
        f"{where}: cannot use {name} (protocol {'/'.join(protocols) or '?'}) as a mailbox: {why}",
        operation="open",
        store=where,
    )


def _check_s3fs_version() -> None:
    import s3fs

    parts = []
    for piece in str(getattr(s3fs, "__version__", "0")).split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    if tuple(parts) < MIN_S3FS_VERSION:
        raise UnsafeStoreError(
            f"s3fs {s3fs.__version__} does not send If-None-Match with 'xb' writes; "
            "pip install 's3fs>=2025.7' (or open s3:// with open_mailbox: S3Mailbox needs boto3)",
            operation="open",
        )


class FsspecMailbox(BaseMailbox):
    """A mailbox under ``root`` on the fsspec filesystem ``fs``.

    Args:
        fs: A filesystem instance; only classes in ``ATOMIC_CREATE`` are accepted.
        root: The mailbox root on ``fs``: a directory for local disk, ``bucket/prefix`` for s3fs.
        block_size: s3fs only: part size of multipart uploads (>= 5 MiB). Values larger than it
            are uploaded in parts; the condition is checked when the upload completes.

    Raises:
        UnsafeStoreError: ``fs`` has no verified atomic create.
    """

    def __init__(self, fs: Any, root: str = "", *, block_size: int | None = None) -> None:
        kind = ATOMIC_CREATE.get(_class_path(fs))
        # A root that is already a URL (``https://host/x``) names itself; else protocol://root.
        where = root if "://" in str(root) else f"{_protocols(fs)[0] if _protocols(fs) else '?'}://{root}"
        if kind is None:
            raise _refusal(_protocols(fs), f"filesystem {_class_path(fs)}", where)
        self.fs = fs
        self.block_size = block_size
        self._pid = os.getpid()
        path = split_protocol(str(root))[1] if root else ""
        if _class_path(fs).startswith("fsspec.implementations.local."):
            self.root = make_path_posix(path) if root else os.getcwd()
            self._impl: _LocalImpl | _S3fsImpl = _LocalImpl(self.root)
        else:
            _check_s3fs_version()
            self.root = path.rstrip("/")
            self._impl = _S3fsImpl(self, self.root)

    @classmethod
    def from_url(cls, url: str, *, block_size: int | None = None, **storage_options: Any) -> FsspecMailbox:
        """Open ``url`` through fsspec (``storage_options`` go to the filesystem).

        ``FsspecMailbox.from_url("s3://bucket/prefix", endpoint_url=...)`` gives an s3fs-backed
        mailbox (``open_mailbox`` maps ``s3://`` to ``S3Mailbox`` instead).
        """
        protocol = url.partition("://")[0].lower() if "://" in url else "file"
        if protocol == "memory" or protocol in _UNVERIFIED:
            raise _refusal((protocol,), "this filesystem", url)
        try:
            fs, path = fsspec.core.url_to_fs(url, **storage_options)
        except ImportError as exc:
            raise MissingExtraError(
                f"{url}: fsspec cannot load the filesystem for {protocol!r}: {exc} "
                "(for s3://: pip install 'gradientmail[fsspec]')"
            ) from exc
        return cls(fs, path, block_size=block_size)

    @property
    def filesystem(self) -> Any:
        """``fs``, rebuilt from its arguments in a forked child (async ones are not fork-safe)."""
        if self._pid != os.getpid():
            self.fs = type(self.fs)(*self.fs.storage_args, **self.fs.storage_options)
            self._pid = os.getpid()
        return self.fs

    @property
    def url(self) -> str:
        return self.fs.unstrip_protocol(self.root)

    def __repr__(self) -> str:
        return f"FsspecMailbox({type(self.fs).__name__}, {self.root!r})"

    def __reduce__(self):
        # fsspec filesystems pickle by rebuilding from their arguments; clients are re-created.
        return (_rebuild, (self.fs, self.root, self.block_size))

    # -- the raw operations (BaseMailbox validated the arguments) -----------------------------
    def _put_if_absent(self, key: str, data: bytes) -> bool:
        return self._impl.put_if_absent(key, data)

    def _get(self, key: str, max_bytes: int | None) -> bytes | None:
        return self._impl.get(key, max_bytes=max_bytes)

    def _put(self, key: str, data: bytes) -> None:
        self._impl.put(key, data)

    def _delete(self, key: str) -> None:
        self._impl.delete(key)

    def _list(self, prefix: str, start_after: str | None) -> Iterator[str]:
        return self._impl.list(prefix, start_after)


def _rebuild(fs: Any, root: str, block_size: int | None) -> FsspecMailbox:
    return FsspecMailbox(fs, root, block_size=block_size)


class _LocalImpl(LocalMailbox):
    """Local disk: exactly the ``LocalMailbox`` mechanism."""


class _S3fsImpl:
    """The s3fs operations; keys and values arrive validated."""

    def __init__(self, owner: FsspecMailbox, root: str) -> None:
        bucket, _, prefix = root.partition("/")
        if not bucket:
            raise ValueError(f"an s3fs mailbox root is 'bucket' or 'bucket/prefix', not {root!r}")
        validate_prefix(prefix)
        self.owner = owner
        self.bucket = bucket
        self.prefix = prefix + "/" if prefix else ""

    @property
    def fs(self) -> Any:
        return self.owner.filesystem

    def _error(self, operation: str, key: str, exc: BaseException) -> MailboxError:
        code = error_code(exc)
        if code == "NoSuchBucket":
            cause = f"bucket {self.bucket!r} does not exist at this endpoint"
        elif isinstance(exc, PermissionError) or code in CREDENTIAL_CODES:
            cause = "the credentials were rejected or lack permission"
        elif "credentials" in str(exc).lower():
            cause = "no usable AWS credentials (environment, profile, ~/.aws or a role)"
        else:
            cause = "the store failed after s3fs's retries"
        store = self.owner.url
        return MailboxError(
            f"{store}: {operation}({key!r}) failed: {type(exc).__name__}: {exc} ({cause})",
            operation=operation,
            key=key,
            store=store,
        )

    def put_if_absent(self, key: str, body: bytes) -> bool:
        name = self.prefix + key
        if not body:
            raise ValueError(
                f"{self.owner.url}: put_if_absent({key!r}) with an empty value: s3fs writes an "
                "empty 'xb' file through touch() without If-None-Match, which would overwrite "
                "silently. Store at least one byte (or use S3Mailbox, which has no such limit)"
            )
        token = uuid.uuid4().hex
        path = f"{self.bucket}/{name}"
        options: dict[str, Any] = {"Metadata": {TOKEN_METADATA: token}}
        if self.owner.block_size:
            options["block_size"] = self.owner.block_size
        handle = self.fs.open(path, "xb", **options)
        try:
            handle.write(body)
            handle.close()
            return True
        except FileExistsError:
            _discard(handle)
            return self._created_by(name, key, token)
        except Exception as exc:
            _discard(handle)
            if error_code(exc) == "PreconditionFailed":
                # A 412 that s3fs did not map to FileExistsError (no Condition in the answer).
                return self._created_by(name, key, token)
            return self._settle(name, key, token, exc)

    def _settle(self, name: str, key: str, token: str, exc: Exception) -> bool:
        """s3fs gave up, yet one of its attempts may have created the object."""
        if isinstance(exc, MailboxError):
            raise exc
        if self._created_by(name, key, token):
            return True
        raise self._error("put_if_absent", key, exc) from exc

    def _created_by(self, name: str, key: str, token: str) -> bool:
        try:
            response = self.fs.call_s3("head_object", Bucket=self.bucket, Key=name)
        except FileNotFoundError as exc:
            if error_code(exc) == "NoSuchBucket":
                raise self._error("put_if_absent", key, exc) from exc
            return False
        except Exception as exc:
            raise self._error("put_if_absent (reading back the claim)", key, exc) from exc
        return (response.get("Metadata") or {}).get(TOKEN_METADATA) == token

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        """One GetObject; with ``max_bytes``, of the first ``max_bytes + 1`` bytes only (``Range``).

        s3fs returns only the bytes, not the object's size, so a longer value is refused
        without naming it (by ``BaseMailbox``).
        """
        name = self.prefix + key
        path = f"{self.bucket}/{name}"
        try:
            # max_concurrency=1: one GetObject, no HeadObject first and no cached sizes.
            if max_bytes is None:
                return self.fs.cat_file(path, max_concurrency=1)
            try:
                return self.fs.cat_file(path, start=0, end=max_bytes + 1, max_concurrency=1)
            except OSError as exc:
                if error_code(exc) != EMPTY_RANGE_CODE:
                    raise
                return b""  # an empty object has no byte 0 to range over
        except FileNotFoundError as exc:
            if error_code(exc) in ("NoSuchBucket",):
                raise self._error("get", key, exc) from exc
            return None
        except (IsADirectoryError, NotADirectoryError):
            return None
        except Exception as exc:
            raise self._error("get", key, exc) from exc

    def put(self, key: str, data: bytes) -> None:
        name = self.prefix + key
        try:
            self.fs.pipe_file(f"{self.bucket}/{name}", data)
        except Exception as exc:
            raise self._error("put", key, exc) from exc

    def delete(self, key: str) -> None:
        name = self.prefix + key
        try:
            self.fs.call_s3("delete_object", Bucket=self.bucket, Key=name)
        except FileNotFoundError as exc:
            if error_code(exc) == "NoSuchBucket":
                raise self._error("delete", key, exc) from exc
        except Exception as exc:
            raise self._error("delete", key, exc) from exc
        self.fs.invalidate_cache(f"{self.bucket}/{name}")

    def list(self, prefix: str, start_after: str | None) -> Iterator[str]:
        def fetch(request: dict[str, Any]) -> Any:
            try:
                return self.fs.call_s3("list_objects_v2", **request)
            except Exception as exc:
                raise self._error("list", prefix, exc) from exc

        return list_keys(fetch, self.bucket, self.prefix, prefix, start_after)


def _discard(handle: Any) -> None:
    """Abort a failed s3fs write (an unfinished multipart upload would be billed)."""
    try:
        handle.discard()
    except Exception:
        pass
