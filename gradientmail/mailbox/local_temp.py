"""``LocalMailbox``'s temporary files: written whole, removed on failure, swept when stale.

A temporary file's name carries its writer (this host's token and the PID), so ``list`` can sweep
those of dead writers at once, never a live one's, and another host's after ``STALE_TEMP_SECONDS``
by the store's clock. See docs/mailboxes.md.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import socket
import uuid

__all__ = [
    "host_token",
    "remove_temp",
    "sweep_temp",
    "write_temp",
]


STALE_TEMP_SECONDS = 3600.0
"""Age after which any temporary file is swept, whoever wrote it (clock skew included)."""

_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_LEAF_BYTES = 64  # the key's name in a temporary name is only a hint; keep under NAME_MAX

_TEMP = re.compile(r"\.(?P<leaf>.*)\.(?P<host>[0-9a-f]{12})\.(?P<pid>[0-9]{1,10})\.[0-9a-f]{32}\.tmp")
_OLD_TEMP = re.compile(r"\.(?P<leaf>.+)\.[0-9a-f]{32}\.tmp")  # before names carried writers


def _read_or_empty(path: str) -> str:
    """The stripped text of a small file (``/proc``), or "" when it cannot be read."""
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            return handle.read().strip()
    except OSError:
        return ""


@functools.lru_cache(maxsize=1)
def host_token() -> str:
    """12 hex digits naming this host, boot and PID namespace: where a PID means one process."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    identity = "\0".join((socket.gethostname(), _read_or_empty("/proc/sys/kernel/random/boot_id"), namespace))
    return hashlib.sha256(identity.encode("utf-8", "surrogateescape")).hexdigest()[:12]


def temp_name(leaf: str) -> str:
    """A fresh hidden name for a value of ``leaf`` written by this process."""
    hint = leaf.encode("utf-8", "surrogateescape")[:_LEAF_BYTES].decode("utf-8", "ignore")
    return f".{hint}.{host_token()}.{os.getpid()}.{uuid.uuid4().hex}.tmp"


def write_temp(dir_fd: int, leaf: str, data: bytes) -> str:
    """Write ``data`` whole to a new temporary file in ``dir_fd`` and return its name.

    On any failure (``ENOSPC``, ``EFBIG``, an interrupt) the file is removed before raising: a
    leftover would keep the space, and the next claim would fail too.
    """
    name = temp_name(leaf)
    fd = os.open(name, _WRITE_FLAGS, 0o666, dir_fd=dir_fd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)  # NFS may report a full disk only here
    except BaseException:
        remove_temp(dir_fd, name)
        raise
    return name


def remove_temp(dir_fd: int, name: str) -> None:
    """Remove ``name`` from ``dir_fd`` if it is still there."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def _may_be_running(pid: int) -> bool:
    """False only when process ``pid`` of this host surely no longer exists."""
    if pid <= 0:
        return True  # never signal a process group; leave it to the age bound
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    except OverflowError:
        return False
    return True


def is_temp(name: str) -> bool:
    """Whether ``name`` is a temporary file of a ``LocalMailbox`` write."""
    return bool(_TEMP.fullmatch(name) or _OLD_TEMP.fullmatch(name))


def is_stale(name: str, mtime: float, now: float) -> bool:
    """Whether the temporary file ``name`` (modified at ``mtime``) belongs to no live writer.

    A writer on this host is judged by its process alone, never by a clock (a lister whose
    clock runs an hour ahead swept live writers' files mid-write). Another host's file is stale
    once ``STALE_TEMP_SECONDS`` old by ``now``, which callers take from the store's own clock
    (the directory's modification time), not this machine's.
    """
    match = _TEMP.fullmatch(name)
    if match and match["host"] == host_token():
        return not _may_be_running(int(match["pid"]))
    if not (match or _OLD_TEMP.fullmatch(name)):
        return False
    return now - mtime > STALE_TEMP_SECONDS


def sweep_temp(dir_fd: int, entry: os.DirEntry[str], now: float) -> bool:
    """Remove ``entry`` of ``dir_fd`` if it is a stale temporary file (``is_stale`` by ``now``);
    whether it was removed."""
    if not entry.name.endswith(".tmp") or not is_temp(entry.name):
        return False
    try:
        info = entry.stat(follow_symlinks=False)
    except OSError:
        return False
    if not is_stale(entry.name, info.st_mtime, now):
        return False
    try:
        remove_temp(dir_fd, entry.name)
    except OSError:
        return False  # not ours to remove (permissions): harmless, it is never listed
    return True
