"""``LocalMailbox``: a directory as a mailbox, with safe paths, atomic writes and an index for listings.

Section ``local_paths`` below: Walking a ``LocalMailbox`` without ever following a symbolic link.

Anyone who can write the mailbox could plant a symlink to files outside it, so every directory
below the root is opened relative to its parent with ``O_NOFOLLOW``. See docs/mailboxes.md.

Section ``local_temp`` below: ``LocalMailbox``'s temporary files: written whole, removed on failure, swept when stale.

A temporary file's name carries its writer (this host's token and the PID), so ``list`` can sweep
those of dead writers at once, never a live one's, and another host's after ``STALE_TEMP_SECONDS``
by the store's clock. See docs/mailboxes.md.

Section ``local_index`` below: ``LocalMailbox``'s listing index: the sorted keys of a directory, kept current by a journal.

Reading and sorting a directory of 100k names costs about 200 ms, so a listing that resumes
after a key must not read the directory again. Every process that changes the set of keys (a
create, an overwrite that may create, a delete) appends two records to its host's journal in
the hidden ``.index/`` directory: ``?key`` before the change and ``=key`` after it. A process
keeps, per listed directory, the sorted keys of one full scan and, at each listing, reads only
the journal records appended since its previous listing; every key they name, and every key
whose change began but has not been recorded as finished, is looked up again (``lstat``).

Why a listing sees every key created before it started: a change completed before the listing
started had its ``?`` record appended before it, so the listing reads that record (or did at
an earlier listing) and looks the key up after the change began; if the ``=`` record is not
read yet the key is still being changed and is looked up at every listing until it is. What
the lookup finds is the state at or after the change, whatever order the records and the
lookups interleave in, and a key nobody touched since the last lookup is as it was then. A
process's first listing of a directory notes where each journal ends, then reads the directory
whole: what changed before is in the scan, what changes after is in the journal. One case is
left to the next full scan (``REBUILD_MIN_S``): a writer killed between its change and its
``=`` record while another process was making its first scan of that directory.

A directory holding fewer than ``SCAN_LIMIT`` keys is still read whole at every listing, and a
larger one is read whole again once its index is ``REBUILD_MIN_S`` old (or ``REBUILD_FACTOR``
times its own scan time), so what was put into the directory by hand, or by a process that
does not write the journal, is listed at most that late. Details: docs/mailboxes.md.

Section ``local`` below: ``LocalMailbox``: a directory on a local or shared POSIX filesystem, the embedded default.

Atomicity: a value is written whole to a hidden temporary file, then published with ``os.link``
(create: fails if the name exists) or ``os.replace`` (overwrite), so exactly one racing creator
wins and readers never see a partial value. ``replace_if`` holds a per-key ``fcntl.flock``.
Nothing is reached through a symbolic link (section ``local_paths``); stale temporary files of dead
writers are swept by ``list`` (section ``local_temp``). A listing reads a large directory from an index
kept current by a journal of changes, not whole each time (section ``local_index``): every change is
recorded as begun before it happens and as finished after. A bounded read (``max_bytes``) checks
the file's size (``fstat``) before reading any of it. Details: docs/mailboxes.md.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import fcntl
import functools
import hashlib
import io
import itertools
import os
import re
import socket
import stat
import threading
import time
import uuid
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
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

__all__ = [
    "DIR_FLAGS",
    "INDEX_DIR",
    "Journal",
    "ListingIndex",
    "READ_FLAGS",
    "REBUILD_FACTOR",
    "REBUILD_MIN_S",
    "SCAN_LIMIT",
    "SortedKeys",
    "describe_entry",
    "is_unsafe",
    "listing_index",
    "lstat_mode",
    "open_directory",
    "open_root",
]


# -- local_paths -------------------------------------------------------------------------------------

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


# -- local_temp --------------------------------------------------------------------------------------
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


# -- local_index -------------------------------------------------------------------------------------

INDEX_DIR = ".index"
"""Hidden directory of the journals, one per host (never listed: it starts with ``.``)."""

SCAN_LIMIT = 1000
"""A directory with fewer keys is read whole at every listing (about a millisecond), so stray
entries are warned about and stale temporary files swept as they appear."""

REBUILD_MIN_S = 10.0
"""Age after which a directory's index is rebuilt by a full scan at its next listing..."""

REBUILD_FACTOR = 100.0
"""...or this many times the last scan's duration, if longer: full scans take at most 1 % of
the time of a process that lists all the time."""

_PAGE = 1000  # keys copied out of the index under its lock at a time
_BLOCK = 1000  # keys per block of SortedKeys
_APPEND_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_SUFFIX = ".log"


class SortedKeys:
    """A sorted set of keys in blocks of about ``_BLOCK``: an insert moves one block, not all.

    Example:
        >>> keys = SortedKeys(["b", "a"])
        >>> keys.add("c"), keys.add("a"), keys.discard("b"), keys.page("a", "", 10)
        (True, False, True, ['c'])
    """

    def __init__(self, keys: list[str] | None = None) -> None:
        ordered = sorted(set(keys or ()))
        self._blocks = [ordered[start : start + _BLOCK] for start in range(0, len(ordered), _BLOCK)]
        self._maxes = [block[-1] for block in self._blocks]
        self._length = len(ordered)

    def __len__(self) -> int:
        return self._length

    def add(self, key: str) -> bool:
        """Insert ``key``; whether it was new."""
        if not self._blocks:
            self._blocks, self._maxes, self._length = [[key]], [key], 1
            return True
        index = min(bisect.bisect_left(self._maxes, key), len(self._maxes) - 1)
        block = self._blocks[index]
        at = bisect.bisect_left(block, key)
        if at < len(block) and block[at] == key:
            return False
        block.insert(at, key)
        self._maxes[index] = block[-1]
        self._length += 1
        if len(block) > 2 * _BLOCK:
            self._blocks[index : index + 1] = [block[:_BLOCK], block[_BLOCK:]]
            self._maxes[index : index + 1] = [block[_BLOCK - 1], block[-1]]
        return True

    def discard(self, key: str) -> bool:
        """Remove ``key``; whether it was there."""
        index = bisect.bisect_left(self._maxes, key)
        if index == len(self._maxes):
            return False
        block = self._blocks[index]
        at = bisect.bisect_left(block, key)
        if at == len(block) or block[at] != key:
            return False
        del block[at]
        self._length -= 1
        if block:
            self._maxes[index] = block[-1]
        else:
            del self._blocks[index], self._maxes[index]
        return True

    def page(self, after: str | None, low: str, count: int) -> list[str]:
        """Up to ``count`` keys in order, each ``> after`` (when given) and ``>= low``."""
        if after is not None and after >= low:
            index = bisect.bisect_right(self._maxes, after)
            find: Callable[[list[str]], int] = lambda block: bisect.bisect_right(block, after)  # noqa: E731
        else:
            index = bisect.bisect_left(self._maxes, low)
            find = lambda block: bisect.bisect_left(block, low)  # noqa: E731
        found: list[str] = []
        if index == len(self._blocks):
            return found
        at = find(self._blocks[index])
        while index < len(self._blocks) and len(found) < count:
            block = self._blocks[index]
            found.extend(block[at : at + count - len(found)])
            index, at = index + 1, 0
        return found


class Journal:
    """This host's journal of key changes in one mailbox: ``with journal.change(key): ...``.

    Each record is one ``O_APPEND`` write by a file descriptor opened for it and closed after,
    so records of the processes of one host never interleave, and a shared mount (NFS, where
    ``O_APPEND`` is atomic only within one client; hence a journal per host) publishes each
    record when it is closed.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.name = f"{host_token()}{_SUFFIX}"
        self._directory: int | None = None  # descriptor of .index/, reopened when it was removed
        self._lock = threading.Lock()

    def reset(self) -> None:
        """A new lock (a forked child); the descriptor of ``.index/`` stays valid."""
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def change(self, key: str) -> Iterator[None]:
        """Record ``?key`` (raising if that fails: nothing is changed), run the body, then ``=key``.

        The second record is best effort: without it, listings look the key up at every
        listing instead of once, which is slower but as correct.
        """
        record = os.fsencode(key)
        self._append(b"?" + record + b"\n")
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                self._append(b"=" + record + b"\n")

    def _append(self, record: bytes) -> None:
        directory = self._index_directory()
        fd = os.open(self.name, _APPEND_FLAGS, 0o666, dir_fd=directory)
        try:
            if os.write(fd, record) != len(record):
                raise OSError(f"short write to the journal {INDEX_DIR}/{self.name}")
        finally:
            os.close(fd)

    def _index_directory(self) -> int:
        fd = self._directory
        if fd is not None and _linked(fd):
            return fd  # without the lock: claim threads append at once
        with self._lock:
            fd = self._directory
            if fd is not None and _linked(fd):
                return fd
            # Removed (the mailbox deleted and made again). The old descriptor stays open: a
            # thread may still be using it, and closing it would let its number be reused.
            try:
                fd = open_directory(self.root, [INDEX_DIR], create=True)
            except ParentIsKey:
                raise NotADirectoryError(errno.ENOTDIR, f"{INDEX_DIR} is a file, not the journal directory") from None
            assert fd is not None
            self._directory = fd
            return fd


def _linked(fd: int) -> bool:
    """Whether the directory open as ``fd`` still has a name (it was not removed)."""
    try:
        return os.fstat(fd).st_nlink > 0
    except OSError:
        return False


@dataclass
class _Tree:
    """One listed directory's keys (all below it, as full keys) from its last full scan on."""

    keys: SortedKeys
    built: float  # time.monotonic() of the scan
    scan_s: float

    def stale(self, now: float) -> bool:
        return now - self.built > max(REBUILD_MIN_S, REBUILD_FACTOR * self.scan_s)


TAIL_BYTES = 64
"""The last bytes of a journal read, kept to tell it was not truncated or rewritten in place since."""


def _tail_of(fd: int, size: int) -> bytes:
    """The last ``TAIL_BYTES`` bytes before ``size`` of the open journal ``fd``."""
    start = max(0, size - TAIL_BYTES)
    return os.pread(fd, size - start, start)


@dataclass
class _State:
    """What one process knows: trees by directory, journal read positions, unfinished changes."""

    trees: dict[str, _Tree] = field(default_factory=dict)
    offsets: dict[str, tuple[int, int, bytes]] = field(default_factory=dict)  # name: (inode, bytes read, their end)
    changing: dict[str, int] = field(default_factory=dict)  # key: changes begun, not yet finished
    lock: threading.Lock = field(default_factory=threading.Lock)


class ListingIndex:
    """The listing index of one mailbox directory in this process (``listing_index(path)``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.journal = Journal(root)
        self.full_scans: Counter[str] = Counter()
        """Directories this process read whole, with how often (the others were served from the index)."""
        self._state = _State()

    def reset(self) -> None:
        """Forget everything (a forked child: the parent's locks may be held by a thread it lacks)."""
        self._state = _State()
        self.journal.reset()

    def tree(self, directory: str, scan: Callable[[str], list[str] | None]) -> SortedKeys | None:
        """The keys below ``directory`` as of now; None when it does not exist.

        ``scan(directory)`` reads it whole (None when missing); it runs when the directory is
        small, new to this index, or its index is stale.
        """
        state = self._state
        with state.lock:
            self._catch_up(state)
            tree = state.trees.get(directory)
            now = time.monotonic()
            if tree is not None and len(tree.keys) >= SCAN_LIMIT and not tree.stale(now):
                return tree.keys
            # Records appended from here on are read at the next listing: nothing is missed.
            keys = scan(directory)
            self.full_scans[directory] += 1
            if keys is None:
                state.trees.pop(directory, None)
                return None
            done = time.monotonic()
            tree = _Tree(SortedKeys(keys), done, done - now)
            state.trees[directory] = tree
            return tree.keys

    def keys(self, tree: SortedKeys, prefix: str, start_after: str | None) -> Iterator[str]:
        """Keys of ``tree`` starting with ``prefix``, after ``start_after``, a page at a time."""
        lock = self._state.lock
        after = start_after
        while True:
            with lock:
                page = tree.page(after, prefix, _PAGE)
            if page and not page[-1].startswith(prefix):  # the prefix's keys end in this page
                yield from itertools.takewhile(lambda key: key.startswith(prefix), page)
                return
            yield from page
            if len(page) < _PAGE:
                return
            after = page[-1]

    # -- reading the journals -----------------------------------------------------------------
    def _catch_up(self, state: _State) -> None:
        """Read every journal past what was read, then look up the keys they name."""
        fresh = not state.trees  # nothing to keep current: just note where each journal ends
        touched: set[str] = set()
        journals = self._journals()
        if journals is None:
            state.trees.clear()  # the journals cannot be read: every listing reads the directory
            return
        usable = True
        for name, fd in journals:
            try:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode):
                    usable = False  # a FIFO or device planted there: its records cannot be read
                    continue
                inode, done, tail = state.offsets.get(name, (info.st_ino, 0, b""))
                if inode != info.st_ino:
                    done, tail = 0, b""  # a new journal under this name: all of it is new
                if fresh:
                    state.offsets[name] = (info.st_ino, info.st_size, _tail_of(fd, info.st_size))
                    continue
                if info.st_size < done or (tail and os.pread(fd, len(tail), done - len(tail)) != tail):
                    # Truncated or rewritten in place (same inode): what it held is unknown, so
                    # start over from its end, and read the directories until then.
                    state.offsets[name] = (info.st_ino, info.st_size, _tail_of(fd, info.st_size))
                    usable = False
                    continue
                if info.st_size == done:
                    continue
                data = os.pread(fd, info.st_size - done, done)
            finally:
                os.close(fd)
            end = data.rfind(b"\n") + 1  # a record being written is read whole next time
            state.offsets[name] = (info.st_ino, done + end, (tail + data[:end])[-TAIL_BYTES:])
            for line in data[:end].split(b"\n"):
                key = os.fsdecode(line[1:])
                if line[:1] == b"?":
                    state.changing[key] = state.changing.get(key, 0) + 1
                elif line[:1] == b"=":
                    count = state.changing.pop(key, 0) - 1
                    if count > 0:
                        state.changing[key] = count
                else:
                    continue
                touched.add(key)
        if not usable:
            state.trees.clear()
            state.changing.clear()
            return
        if fresh:
            state.changing.clear()
            return
        touched.update(state.changing)
        if len(touched) > 2 * sum(len(tree.keys) for tree in state.trees.values()) + SCAN_LIMIT:
            state.trees.clear()  # far more changes than keys: reading the directories is cheaper
        elif touched:
            self._look_up(state, touched)

    def _journals(self) -> list[tuple[str, int]] | None:
        """``(name, open descriptor)`` of each journal, which the caller closes; None when the
        ``.index`` directory or a journal in it cannot be used (a symlink planted there)."""
        root = open_root(self.root, create=False)
        if root is None:
            return []
        try:
            try:
                directory = os.open(INDEX_DIR, DIR_FLAGS, dir_fd=root)
            except FileNotFoundError:
                return []  # nothing was ever changed through a journal-writing LocalMailbox
            except OSError:
                return None
        finally:
            os.close(root)
        opened: list[tuple[str, int]] = []
        try:
            for name in sorted(os.listdir(directory)):
                if name.endswith(_SUFFIX):
                    opened.append((name, os.open(name, READ_FLAGS, dir_fd=directory)))
        except FileNotFoundError:
            pass  # removed since the listing of .index: no records to read there
        except OSError:
            for _, fd in opened:
                os.close(fd)
            return None
        finally:
            os.close(directory)
        return opened

    def _look_up(self, state: _State, keys: set[str]) -> None:
        """Add each of ``keys`` that is a regular file to the trees holding it, remove the others."""
        by_parent: dict[str, list[tuple[str, str]]] = {}
        directories = [directory + "/" if directory else "" for directory in state.trees]
        for key in keys:
            if is_valid_key(key) and any(key.startswith(directory) for directory in directories):
                parent, _, leaf = key.rpartition("/")
                by_parent.setdefault(parent, []).append((key, leaf))
        for parent, entries in by_parent.items():
            present = self._present(parent, [leaf for _, leaf in entries])
            for (key, _), exists in zip(entries, present, strict=True):
                for directory, tree in state.trees.items():
                    if directory and not key.startswith(directory + "/"):
                        continue
                    if exists:
                        tree.keys.add(key)
                    else:
                        tree.keys.discard(key)

    def _present(self, parent: str, leaves: list[str]) -> list[bool]:
        try:
            fd = open_directory(self.root, parent.split("/") if parent else [], create=False)
        except (UnsafeEntry, OSError):
            fd = None  # not reachable without a symlink: not listed
        if fd is None:
            return [False] * len(leaves)
        try:
            modes = [lstat_mode(fd, leaf) for leaf in leaves]
        finally:
            os.close(fd)
        return [mode is not None and stat.S_ISREG(mode) for mode in modes]


_INDEXES: weakref.WeakValueDictionary[str, ListingIndex] = weakref.WeakValueDictionary()
_REGISTRY_LOCK = threading.Lock()


def listing_index(root: Path) -> ListingIndex:
    """The listing index of the mailbox at ``root`` shared by this process's ``LocalMailbox``es."""
    with _REGISTRY_LOCK:
        index = _INDEXES.get(str(root))
        if index is None:
            index = ListingIndex(root)
            _INDEXES[str(root)] = index
        return index


def _reset_after_fork() -> None:
    global _REGISTRY_LOCK
    _REGISTRY_LOCK = threading.Lock()
    for index in list(_INDEXES.values()):
        index.reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


# -- local -------------------------------------------------------------------------------------------
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
