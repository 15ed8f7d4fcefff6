"""Walking a ``LocalMailbox`` without ever following a symbolic link.

Anyone who can write the mailbox could plant a symlink to files outside it, so every directory
below the root is opened relative to its parent with ``O_NOFOLLOW``. See docs/mailboxes.md.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from gradientmail.errors import (  # defined there, importable from here as before
    ParentIsKey,
    UnsafeEntry,
)

__all__ = [
    "describe_entry",
    "DIR_FLAGS",
    "is_unsafe",
    "lstat_mode",
    "open_directory",
    "open_root",
    "READ_FLAGS",
]


DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
"""Opening a directory below the root: never through a symlink."""

READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
"""Opening a value: never through a symlink; O_NONBLOCK so that a planted FIFO cannot hang."""

_ROOT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_MISSING_RETRIES = 3  # a directory removed between our mkdir and open (a racing delete)


def describe_entry(dir_fd: int, name: str, relative: str) -> str:
    """What the non-regular, non-directory entry ``name`` of ``dir_fd`` is, for an error message."""
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except OSError:
        return "not a regular file"
    if stat.S_ISLNK(mode):
        try:
            target = os.readlink(name, dir_fd=dir_fd)
        except OSError:
            target = "?"
        shown = target if len(target) <= 200 else target[:200] + "..."
        return (
            f"a symbolic link (to {shown!r}); LocalMailbox never follows symlinks, so that "
            "nothing outside the mailbox is read, written or deleted: remove it"
        )
    kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
    return f"{kind}, not a regular file: remove it"


def lstat_mode(dir_fd: int, name: str) -> int | None:
    """``st_mode`` of ``name`` in ``dir_fd`` without following it; None when it is missing."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return None


def is_unsafe(mode: int) -> bool:
    """Neither a regular file nor a directory (a symlink, FIFO, socket or device)."""
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def open_root(root: Path, *, create: bool) -> int | None:
    """A descriptor of the mailbox root; None when it is missing and ``create`` is False."""
    try:
        return os.open(root, _ROOT_FLAGS)
    except FileNotFoundError:
        if not create:
            return None
    root.mkdir(parents=True, exist_ok=True)  # removed after opening: recreate, as writes did
    return os.open(root, _ROOT_FLAGS)


def open_directory(root: Path, segments: list[str], *, create: bool) -> int | None:
    """A descriptor of the directory ``root/segments...``, never through a symlink.

    Args:
        root: the mailbox root (which may itself be reached through symlinks).
        segments: the directory names below it.
        create: make missing directories; without it a missing one, or one that is a regular
            file, gives None.

    Raises:
        UnsafeEntry: a component is a symlink or special file.
        ParentIsKey: (``create`` only) a component is a regular file, i.e. a key.
    """
    fd = open_root(root, create=create)
    if fd is None:
        return None
    try:
        for depth, name in enumerate(segments):
            child = _open_child(fd, name, "/".join(segments[: depth + 1]), create=create)
            os.close(fd)
            fd = child
            if fd is None:
                return None
        return fd
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise


def _open_child(fd: int, name: str, relative: str, *, create: bool) -> int | None:
    """A descriptor of the directory ``name`` in ``fd``, as ``open_directory`` for one step."""
    for _ in range(_MISSING_RETRIES):
        if create:
            try:
                os.mkdir(name, 0o777, dir_fd=fd)
            except FileExistsError:
                pass
        try:
            return os.open(name, DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                return None
            continue  # removed between mkdir and open: make it again
        except OSError:
            mode = lstat_mode(fd, name)
            if mode is None:
                if not create:
                    return None
                continue
            if stat.S_ISREG(mode):
                if create:
                    raise ParentIsKey(relative) from None
                return None
            if is_unsafe(mode):
                raise UnsafeEntry(relative, describe_entry(fd, name, relative)) from None
            raise
    raise OSError(errno.ENOENT, f"directory {relative!r} kept disappearing while being created")
