"""``FsspecMailbox``: a mailbox on an fsspec filesystem that can create atomically.

fsspec's generic ``pipe_file(mode="create")`` checks for the file and then writes it: two racing
nodes can both win a claim, and reading the claim back cannot compensate for a store that
silently overwrites. So only filesystems whose atomic create was verified, in their code and in
GradientMail's tests, are accepted (``ATOMIC_CREATE``); every other one is refused with
``UnsafeStoreError`` before anything is written.

Verified mechanisms:

- ``LocalFileSystem`` (``file://``): the ``LocalMailbox`` technique, a whole temporary file
  published with ``os.link``; readers never see an empty or partial value.
- ``s3fs.S3FileSystem`` >= 2025.7 (``s3://``): ``open(path, "xb")`` sends ``If-None-Match: *``
  with the single ``PutObject`` or with ``CompleteMultipartUpload`` for large values, so the store
  decides. s3fs commits a zero-byte ``"xb"`` file through ``touch()`` *without* the condition,
  so empty values are refused (``ValueError``). s3fs retries failed requests internally and hides
  that from its caller, so a "file exists" answer may be about this call's own write: every
  ``put_if_absent`` carries a random token as object metadata (``x-amz-meta-gm-token``), and
  every "exists" answer, or failure, is settled by reading the token back (one ``HeadObject``).

Not verified yet, hence refused: gcsfs and adlfs (both document an atomic ``"xb"``), and every
other filesystem. ``memory://`` filesystems live in one process: use ``open_mailbox("memory://x")``
(a ``MemoryMailbox``, which says so when it crosses a process boundary) instead.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
import fsspec.core

from gradientmail.errors import MailboxError, MissingExtraError, UnsafeStoreError
from gradientmail.mailbox.base import verify_mailbox
from gradientmail.mailbox.keys import validate_key, validate_prefix, validate_value
from gradientmail.mailbox.local import LocalMailbox
from gradientmail.mailbox.s3_listing import list_keys

TOKEN_METADATA = "gm-token"
"""User-metadata name of the per-call creation token on s3fs (``x-amz-meta-gm-token``)."""

MIN_S3FS_VERSION = (2025, 7)
LIST_PAGE = 1000

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


class FsspecMailbox:
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
        if _class_path(fs).startswith("fsspec.implementations.local."):
            self.root = fs._strip_protocol(root) if root else os.getcwd()
            self._impl: _LocalImpl | _S3fsImpl = _LocalImpl(self.root)
        else:
            _check_s3fs_version()
            self.root = fs._strip_protocol(root).rstrip("/")
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

    # -- the five primitives ---------------------------------------------------------------
    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self._impl.put_if_absent(key, data)

    def get(self, key: str) -> bytes | None:
        return self._impl.get(key)

    def put(self, key: str, data: bytes) -> None:
        self._impl.put(key, data)

    def delete(self, key: str) -> None:
        self._impl.delete(key)

    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        return self._impl.list(prefix, start_after)

    def verify(self) -> None:
        """Check that conditional creation works here (see ``verify_mailbox``)."""
        verify_mailbox(self)


def _rebuild(fs: Any, root: str, block_size: int | None) -> FsspecMailbox:
    return FsspecMailbox(fs, root, block_size=block_size)


class _LocalImpl(LocalMailbox):
    """Local disk: exactly the ``LocalMailbox`` mechanism."""


class _S3fsImpl:
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

    def _key(self, key: str) -> str:
        return self.prefix + validate_key(key)

    def _error(self, operation: str, key: str, exc: BaseException) -> MailboxError:
        code = _s3_code(exc)
        if code == "NoSuchBucket":
            cause = f"bucket {self.bucket!r} does not exist at this endpoint"
        elif isinstance(exc, PermissionError) or code in ("AccessDenied", "InvalidAccessKeyId"):
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

    def put_if_absent(self, key: str, data: bytes) -> bool:
        name = self._key(key)
        body = validate_value(data, key)
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
            if _s3_code(exc) == "PreconditionFailed":
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
            if _s3_code(exc) == "NoSuchBucket":
                raise self._error("put_if_absent", key, exc) from exc
            return False
        except Exception as exc:
            raise self._error("put_if_absent (reading back the claim)", key, exc) from exc
        return (response.get("Metadata") or {}).get(TOKEN_METADATA) == token

    def get(self, key: str) -> bytes | None:
        name = self._key(key)
        try:
            # max_concurrency=1: one GetObject, no HeadObject first and no cached sizes.
            return self.fs.cat_file(f"{self.bucket}/{name}", max_concurrency=1)
        except FileNotFoundError as exc:
            if _s3_code(exc) in ("NoSuchBucket",):
                raise self._error("get", key, exc) from exc
            return None
        except (IsADirectoryError, NotADirectoryError):
            return None
        except Exception as exc:
            raise self._error("get", key, exc) from exc

    def put(self, key: str, data: bytes) -> None:
        name = self._key(key)
        body = validate_value(data, key)
        try:
            self.fs.pipe_file(f"{self.bucket}/{name}", body)
        except Exception as exc:
            raise self._error("put", key, exc) from exc

    def delete(self, key: str) -> None:
        name = self._key(key)
        try:
            self.fs.call_s3("delete_object", Bucket=self.bucket, Key=name)
        except FileNotFoundError as exc:
            if _s3_code(exc) == "NoSuchBucket":
                raise self._error("delete", key, exc) from exc
        except Exception as exc:
            raise self._error("delete", key, exc) from exc
        self.fs.invalidate_cache(f"{self.bucket}/{name}")

    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
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


def _s3_code(exc: BaseException) -> str:
    """The S3 error code behind an exception s3fs translated (``NoSuchBucket``...), or ''."""
    seen = exc
    for _ in range(4):
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            return str((response.get("Error") or {}).get("Code") or "")
        if seen.__cause__ is None:
            break
        seen = seen.__cause__
    return ""
