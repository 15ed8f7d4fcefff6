"""``LocalMailbox``: a directory on a local or shared POSIX filesystem, the embedded default.

Atomicity: a value is first written whole to a hidden temporary file in the target directory,
then published with ``os.link`` (create) or ``os.replace`` (overwrite). ``link`` fails if the
name exists, so exactly one racing creator wins, and a reader sees either no file or the whole
value; ``O_EXCL`` alone would expose an empty file between create and write. Both calls are
atomic on local filesystems and on NFSv3+; temporary files start with ``.`` and never show up
in ``list``.

Compare-and-swap (``replace_if``, for leases and resume): the version of a value is its SHA-256.
``replace_if`` holds an exclusive ``fcntl.flock`` on a per-key lock file under the hidden
``.locks/`` directory while it reads, compares and publishes with ``os.replace``, so among
processes on one machine exactly one of several racing callers with the same version wins.
It never creates, and ``put_if_absent`` never replaces, so the two cannot interleave badly;
an unconditional ``put`` or ``delete`` of the same key is not ordered against it. ``flock`` is not
reliable over every network filesystem (NFS maps it to byte-range locks, which need a working
lock manager); use S3 for leases across machines unless your shared filesystem is known to
honour it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

from gradientmail.errors import KeyConflictError, MailboxError
from gradientmail.mailbox.base import verify_mailbox
from gradientmail.mailbox.keys import validate_key, validate_prefix, validate_value


LOCK_DIR = ".locks"
"""Hidden directory of ``replace_if``'s per-key lock files (never listed: it starts with ``.``)."""


def _version(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class LocalMailbox:
    """A mailbox in the directory ``path`` (created unless ``create=False``)."""

    def __init__(self, path: str | os.PathLike[str], *, create: bool = True) -> None:
        self.path = Path(path).expanduser().absolute()
        if create:
            self.path.mkdir(parents=True, exist_ok=True)
        elif not self.path.is_dir():
            raise FileNotFoundError(f"no mailbox directory at {self.path}")

    @property
    def url(self) -> str:
        return self.path.as_uri()

    def __repr__(self) -> str:
        return f"LocalMailbox({str(self.path)!r})"

    def __reduce__(self):
        return (LocalMailbox, (str(self.path),))

    # -- helpers ---------------------------------------------------------------------------
    def _target(self, key: str) -> Path:
        return self.path.joinpath(*validate_key(key).split("/"))

    def _write_temp(self, target: Path, data: bytes, key: str) -> Path:
        validate_value(data, key)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as exc:
            raise KeyConflictError(
                f"{self.url}: cannot store {key!r}: a parent of it is an existing key",
                operation="write", key=key, store=self.url,
            ) from exc
        temp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
        with open(temp, "xb") as handle:
            handle.write(data)
        return temp

    # -- the five primitives ---------------------------------------------------------------
    def put_if_absent(self, key: str, data: bytes) -> bool:
        target = self._target(key)
        if os.path.isfile(target):
            # It exists now, so False is a truthful answer; skips writing a temporary file.
            validate_value(data, key)
            return False
        temp = self._write_temp(target, data, key)
        try:
            os.link(temp, target)
            return True
        except FileExistsError:
            if target.is_dir() and not target.is_symlink():
                # "False" would claim the key exists while get() returns None.
                raise KeyConflictError(
                    f"{self.url}: cannot store {key!r}: other keys live under it",
                    operation="put_if_absent", key=key, store=self.url,
                ) from None
            return False
        except OSError as exc:
            raise MailboxError(
                f"{self.url}: put_if_absent({key!r}) failed: {exc}",
                operation="put_if_absent", key=key, store=self.url,
            ) from exc
        finally:
            temp.unlink(missing_ok=True)

    # -- compare-and-swap (optional capability, see VersionedMailbox) ------------------------
    supports_replace_if = True

    @contextlib.contextmanager
    def _key_lock(self, key: str) -> Iterator[None]:
        locks = self.path / LOCK_DIR
        locks.mkdir(exist_ok=True)
        name = hashlib.sha256(key.encode()).hexdigest()[:40]
        fd = os.open(locks / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def get_versioned(self, key: str) -> tuple[bytes, str] | None:
        data = self.get(key)
        return None if data is None else (data, _version(data))

    def replace_if(self, key: str, data: bytes, version: str) -> bool:
        target = self._target(key)
        validate_value(data, key)
        if not isinstance(version, str):
            raise TypeError(f"version must be a str from get_versioned, not {type(version).__name__}")
        with self._key_lock(key):
            current = self.get(key)
            if current is None or _version(current) != version:
                return False
            temp = self._write_temp(target, data, key)
            try:
                os.replace(temp, target)
            except BaseException:
                temp.unlink(missing_ok=True)
                raise
            return True

    def put(self, key: str, data: bytes) -> None:
        target = self._target(key)
        temp = self._write_temp(target, data, key)
        try:
            os.replace(temp, target)
        except IsADirectoryError as exc:
            temp.unlink(missing_ok=True)
            raise KeyConflictError(
                f"{self.url}: cannot store {key!r}: other keys live under it",
                operation="put", key=key, store=self.url,
            ) from exc
        except BaseException:
            temp.unlink(missing_ok=True)
            raise

    def get(self, key: str) -> bytes | None:
        try:
            with open(self._target(key), "rb") as handle:
                return handle.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._target(key))
        except (FileNotFoundError, NotADirectoryError):
            pass
        except IsADirectoryError:
            pass
        except OSError as exc:
            if exc.errno != errno.EISDIR:
                raise

    def list(self, prefix: str = "", start_after: str | None = None) -> Iterator[str]:
        validate_prefix(prefix)
        # Only the directory named by the prefix's complete segments needs walking.
        directory, _, _ = prefix.rpartition("/")
        base = self.path.joinpath(*directory.split("/")) if directory else self.path
        keys = sorted(
            key for key in self._walk(base, directory)
            if key.startswith(prefix) and (start_after is None or key > start_after)
        )
        yield from keys

    def _walk(self, base: Path, relative: str) -> Iterator[str]:
        try:
            entries = list(os.scandir(base))
        except (FileNotFoundError, NotADirectoryError):
            return
        for entry in entries:
            if entry.name.startswith("."):
                continue
            key = f"{relative}/{entry.name}" if relative else entry.name
            if entry.is_dir(follow_symlinks=False):
                yield from self._walk(Path(entry.path), key)
            else:
                yield key

    def verify(self) -> None:
        """Check that conditional creation works here (see ``verify_mailbox``)."""
        verify_mailbox(self)
