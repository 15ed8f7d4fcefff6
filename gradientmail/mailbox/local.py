"""``LocalMailbox``: a directory on a local or shared POSIX filesystem, the embedded default.

Atomicity: a value is written whole to a hidden temporary file, then published with ``os.link``
(create: fails if the name exists) or ``os.replace`` (overwrite), so exactly one racing creator
wins and readers never see a partial value. ``replace_if`` holds a per-key ``fcntl.flock``.
Nothing is reached through a symbolic link (``mailbox.local_paths``); stale temporary files of dead
writers are swept by ``list`` (``mailbox.local_temp``). A listing reads a large directory from an index
kept current by a journal of changes, not whole each time (``mailbox.local_index``): every change is
recorded as begun before it happens and as finished after. A bounded read (``max_bytes``) checks
the file's size (``fstat``) before reading any of it. Details: docs/mailboxes.md.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import os
import stat
import warnings
from collections.abc import Iterator
from pathlib import Path

from gradientmail.errors import (  # defined there, importable from here as before
    KeyConflictError,
    MailboxError,
    MailSkippedWarning,
    ParentIsKey,
    UnsafeEntry,
    ValueTooLargeError,
)
from gradientmail.mailbox.base import BaseVersionedMailbox
from gradientmail.mailbox.keys import is_valid_key, validate_key
from gradientmail.mailbox.local_index import listing_index
from gradientmail.mailbox.local_paths import (
    DIR_FLAGS,
    READ_FLAGS,
    describe_entry,
    is_unsafe,
    lstat_mode,
    open_directory,
    open_root,
)
from gradientmail.mailbox.local_temp import remove_temp, sweep_temp, write_temp

__all__ = [
    "LocalMailbox",
    "LOCK_DIR",
]


LOCK_DIR = ".locks"
"""Hidden directory of ``replace_if``'s per-key lock files (never listed: it starts with ``.``)."""

_HINTS = {
    errno.ENOSPC: " (the mailbox's filesystem is full)",
    errno.EDQUOT: " (a disk quota is exhausted)",
    errno.EFBIG: " (a file size limit was reached)",
    errno.EROFS: " (the mailbox's filesystem is read-only)",
    errno.EACCES: " (no permission on the mailbox directory)",
}


def _version(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


_READ_BLOCK = 2**20


def _read_at_most(stream: io.BufferedReader, count: int) -> bytes:
    """The next ``count`` bytes of ``stream`` or fewer at its end, read a block at a time: a
    single ``read(count)`` would allocate ``count`` bytes first, whatever the file holds."""
    blocks = []
    while count > 0:
        block = stream.read(min(count, _READ_BLOCK))
        if not block:
            break
        blocks.append(block)
        count -= len(block)
    return b"".join(blocks)


class LocalMailbox(BaseVersionedMailbox):
    """A mailbox in a directory that every node can reach (a local disk or a shared mount).

    Args:
        path: The mailbox directory.
        create: Create the directory when missing; False refuses a missing one.

    Raises:
        FileNotFoundError: ``create=False`` and there is no directory at ``path``.

    Example:
        >>> import tempfile
        >>> from gradientmail.mailbox import LocalMailbox
        >>> box = LocalMailbox(tempfile.mkdtemp())
        >>> box.put_if_absent("units/1", b"mine"), box.put_if_absent("units/1", b"yours")
        (True, False)
        >>> box.get("units/1"), list(box.list())
        (b'mine', ['units/1'])
    """

    def __init__(self, path: str | os.PathLike[str], *, create: bool = True) -> None:
        self.path = Path(path).expanduser().absolute()
        if create:
            self.path.mkdir(parents=True, exist_ok=True)
        elif not self.path.is_dir():
            raise FileNotFoundError(f"no mailbox directory at {self.path}")
        self._listing = listing_index(self.path)

    @property
    def url(self) -> str:
        return self.path.as_uri()

    def __repr__(self) -> str:
        return f"LocalMailbox({str(self.path)!r})"

    def __reduce__(self):
        return (LocalMailbox, (str(self.path),))

    # -- helpers ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _failures(self, operation: str, key: str) -> Iterator[None]:
        """Turn unsafe entries and local I/O errors into ``MailboxError`` naming the key."""
        try:
            yield
        except MailboxError:
            raise
        except UnsafeEntry as exc:
            raise MailboxError(
                f"{self.url}: {operation}({key!r}) refused: {exc}",
                operation=operation,
                key=key,
                store=self.url,
            ) from None
        except OSError as exc:
            raise MailboxError(
                f"{self.url}: {operation}({key!r}) failed: {type(exc).__name__}: {exc}{_HINTS.get(exc.errno or 0, '')}",
                operation=operation,
                key=key,
                store=self.url,
            ) from exc

    def _conflict(self, operation: str, key: str, why: str) -> KeyConflictError:
        return KeyConflictError(
            f"{self.url}: cannot store {key!r}: {why}", operation=operation, key=key, store=self.url
        )

    @contextlib.contextmanager
    def _parent(self, operation: str, key: str, *, create: bool) -> Iterator[tuple[int | None, str]]:
        """``(descriptor of the key's directory or None when missing, the key's last segment)``."""
        *directories, leaf = validate_key(key).split("/")
        try:
            fd = open_directory(self.path, directories, create=create)
        except ParentIsKey:
            raise self._conflict(operation, key, "a parent of it is an existing key") from None
        try:
            yield fd, leaf
        finally:
            if fd is not None:
                os.close(fd)

    def _leaf_mode(self, fd: int, leaf: str, key: str) -> int | None:
        """The mode of an existing key's entry (None when missing); refuses unsafe entries."""
        mode = lstat_mode(fd, leaf)
        if mode is not None and is_unsafe(mode):
            raise UnsafeEntry(key, describe_entry(fd, leaf, key))
        return mode

    # -- the five primitives ---------------------------------------------------------------
    def _put_if_absent(self, key: str, data: bytes) -> bool:
        with self._failures("put_if_absent", key), self._parent("put_if_absent", key, create=True) as (fd, leaf):
            assert fd is not None
            if self._created(fd, leaf, key) is not None:
                # It exists now, so False is a truthful answer; skips writing a temporary file.
                return False
            temp = write_temp(fd, leaf, data)
            try:
                with self._listing.journal.change(key):
                    os.link(temp, leaf, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
                return True
            except FileExistsError:
                self._created(fd, leaf, key)  # a directory or symlink there: raises
                return False
            finally:
                remove_temp(fd, temp)

    def _created(self, fd: int, leaf: str, key: str) -> bool | None:
        """False when ``key`` exists as a value, None when missing; raises on anything else."""
        mode = self._leaf_mode(fd, leaf, key)
        if mode is not None and stat.S_ISDIR(mode):
            # "False" would claim the key exists while get() returns None.
            raise self._conflict("put_if_absent", key, "other keys live under it")
        return None if mode is None else False

    # -- compare-and-swap (see VersionedMailbox) -----------------------------------------------
    @contextlib.contextmanager
    def _key_lock(self, key: str) -> Iterator[None]:
        root = open_root(self.path, create=True)
        assert root is not None
        try:
            try:
                os.mkdir(LOCK_DIR, 0o777, dir_fd=root)
            except FileExistsError:
                pass
            try:
                locks = os.open(LOCK_DIR, DIR_FLAGS, dir_fd=root)
            except OSError:
                if is_unsafe(lstat_mode(root, LOCK_DIR) or stat.S_IFDIR):
                    raise UnsafeEntry(LOCK_DIR, describe_entry(root, LOCK_DIR, LOCK_DIR)) from None
                raise
        finally:
            os.close(root)
        name = f"{hashlib.sha256(key.encode()).hexdigest()[:40]}.lock"
        try:
            flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
            try:
                fd = os.open(name, flags, 0o644, dir_fd=locks)
            except OSError:
                if is_unsafe(lstat_mode(locks, name) or stat.S_IFREG):
                    relative = f"{LOCK_DIR}/{name}"
                    raise UnsafeEntry(relative, describe_entry(locks, name, relative)) from None
                raise
        finally:
            os.close(locks)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def _get_versioned(self, key: str, max_bytes: int | None) -> tuple[bytes, str] | None:
        data = self._get(key, max_bytes)
        return None if data is None else (data, _version(data))

    def _replace_if(self, key: str, data: bytes, version: str) -> bool:
        with self._failures("replace_if", key), self._key_lock(key):
            current = self._get(key, None)
            if current is None or _version(current) != version:
                return False
            self._publish("replace_if", key, data)
            return True

    def _put(self, key: str, data: bytes) -> None:
        with self._failures("put", key):
            self._publish("put", key, data)

    def _publish(self, operation: str, key: str, data: bytes) -> None:
        """Write ``data`` to a temporary file and rename it over ``key``."""
        with self._parent(operation, key, create=True) as (fd, leaf):
            assert fd is not None
            mode = self._leaf_mode(fd, leaf, key)
            if mode is not None and stat.S_ISDIR(mode):
                raise self._conflict(operation, key, "other keys live under it")
            temp = write_temp(fd, leaf, data)
            try:
                # rename() replaces a symlink swapped in since the check; it never follows it.
                with self._listing.journal.change(key):  # it may create the key
                    os.replace(temp, leaf, src_dir_fd=fd, dst_dir_fd=fd)
            except IsADirectoryError:
                remove_temp(fd, temp)
                raise self._conflict(operation, key, "other keys live under it") from None
            except BaseException:
                remove_temp(fd, temp)
                raise

    def _get(self, key: str, max_bytes: int | None) -> bytes | None:
        """The value, its size checked against ``max_bytes`` (``fstat``) before reading any of it;
        then at most ``max_bytes + 1`` bytes are read, in case the file grew since."""
        with self._failures("get", key), self._parent("get", key, create=False) as (fd, leaf):
            if fd is None:
                return None
            try:
                handle = os.open(leaf, READ_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                return None
            except OSError:
                self._leaf_mode(fd, leaf, key)  # a symlink: refused, naming it
                raise
            try:
                info = os.fstat(handle)
                if not stat.S_ISREG(info.st_mode):
                    if stat.S_ISDIR(info.st_mode):
                        return None
                    raise UnsafeEntry(key, describe_entry(fd, leaf, key))
                if max_bytes is not None and info.st_size > max_bytes:
                    raise ValueTooLargeError(key, max_bytes, info.st_size, store=self.url)
            except BaseException:
                os.close(handle)
                raise
            with open(handle, "rb") as stream:
                return stream.read() if max_bytes is None else _read_at_most(stream, max_bytes + 1)

    def _delete(self, key: str) -> None:
        with self._failures("delete", key), self._parent("delete", key, create=False) as (fd, leaf):
            if fd is None:
                return
            mode = lstat_mode(fd, leaf)
            if mode is None or stat.S_ISDIR(mode):
                return
            if stat.S_ISLNK(mode):
                raise UnsafeEntry(key, describe_entry(fd, leaf, key))
            try:
                with self._listing.journal.change(key):
                    os.unlink(leaf, dir_fd=fd)  # never follows a symlink swapped in since
            except (FileNotFoundError, IsADirectoryError):
                pass

    def _list(self, prefix: str, start_after: str | None) -> Iterator[str]:
        # Only the directory named by the prefix's complete segments needs walking, and only
        # when it is small or its index is new or old (section local_index); otherwise the index serves.
        directory, _, _ = prefix.rpartition("/")
        skipped: list[tuple[str, str]] = []
        with self._failures("list", prefix):
            keys = self._listing.tree(directory, lambda name: self._scan(name, skipped))
        # The listed directory itself may be the unsafe entry: it is above the prefix.
        _skip(self.url, [(key, why) for key, why in skipped if key.startswith(prefix) or prefix.startswith(key + "/")])
        if keys is not None:
            yield from self._listing.keys(keys, prefix, start_after)

    def _scan(self, directory: str, skipped: list[tuple[str, str]]) -> list[str] | None:
        """Every key below ``directory`` (None when it is missing); what is not a key goes to ``skipped``."""
        try:
            fd = open_directory(self.path, directory.split("/") if directory else [], create=False)
        except UnsafeEntry as exc:
            skipped.append((exc.relative, exc.what))
            return None
        if fd is None:
            return None
        try:
            return list(self._walk(fd, directory, skipped))
        finally:
            os.close(fd)

    def _walk(self, fd: int, relative: str, skipped: list[tuple[str, str]]) -> Iterator[str]:
        """Keys under ``fd``; entries that are not keys go to ``skipped`` with the reason."""
        with os.scandir(fd) as scan:
            entries = list(scan)
        # The store's clock: the directory changed when its newest entry came or went (a quiet
        # directory's is older: its other hosts' temporary files are swept later, never early).
        now = os.fstat(fd).st_mtime
        for entry in entries:
            if entry.name.startswith("."):
                sweep_temp(fd, entry, now)
                continue
            key = f"{relative}/{entry.name}" if relative else entry.name
            if not is_valid_key(key):
                skipped.append((key, "not a valid mailbox key"))
            elif entry.is_symlink():
                skipped.append((key, describe_entry(fd, entry.name, key)))
            elif entry.is_dir(follow_symlinks=False):
                try:
                    child = os.open(entry.name, DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    continue  # removed since the scan
                except OSError:
                    skipped.append((key, describe_entry(fd, entry.name, key)))
                    continue
                try:
                    yield from self._walk(child, key, skipped)
                finally:
                    os.close(child)
            elif entry.is_file(follow_symlinks=False):
                yield key
            else:
                skipped.append((key, describe_entry(fd, entry.name, key)))


def _skip(store: str, entries: list[tuple[str, str]]) -> None:
    """One warning per skipped entry, attributed to the code that called ``list``."""
    for key, why in entries:
        warnings.warn(f"{store}: list skips {key!r}: {why}", MailSkippedWarning, stacklevel=3)
