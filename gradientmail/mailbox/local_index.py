"""``LocalMailbox``'s listing index: the sorted keys of a directory, kept current by a journal.

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
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import itertools
import os
import stat
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from gradientmail.errors import (  # defined there, importable from here as before
    ParentIsKey,
    UnsafeEntry,
)
from gradientmail.mailbox.keys import is_valid_key
from gradientmail.mailbox.local_paths import DIR_FLAGS, READ_FLAGS, lstat_mode, open_directory, open_root
from gradientmail.mailbox.local_temp import host_token

__all__ = [
    "INDEX_DIR",
    "Journal",
    "listing_index",
    "ListingIndex",
    "REBUILD_FACTOR",
    "REBUILD_MIN_S",
    "SCAN_LIMIT",
    "SortedKeys",
]


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
