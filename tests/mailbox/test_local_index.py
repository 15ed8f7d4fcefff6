"""``LocalMailbox``'s listing index against writers in other processes.

A directory of ``SCAN_LIMIT`` keys or more is listed from the index, not read again: these tests
build the index once, count the full scans, and check every listing against the directory's
truth while real child processes create and delete keys (``subprocess``, never threads): one
reporting each key it created only after ``put_if_absent`` returned, one SIGKILLed just after its
``os.link`` (before it could record the change as finished). Nothing depends on timing: each
child reports through a pipe, and each check compares with what was reported before the call.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradientmail import LocalMailbox, MailboxError
from gradientmail.mailbox import local_index
from gradientmail.mailbox.local_index import SortedKeys

pytestmark = pytest.mark.slow  # most tests here start processes

SMALL_LIMIT = 20  # directories of this many keys are served from the index in these tests


class Scans:
    """How often this process read each directory of a mailbox whole (``ListingIndex.full_scans``)."""

    def __init__(self, box: LocalMailbox) -> None:
        self.counts = local_index.listing_index(box.path).full_scans

    def mark(self) -> dict[str, int]:
        return dict(self.counts)

    def since(self, mark: dict[str, int]) -> set[str]:
        return {directory for directory, count in self.counts.items() if count > mark.get(directory, 0)}


@pytest.fixture
def scans(monkeypatch, local_mailbox) -> Scans:
    """The full scans of ``local_mailbox``, with a small ``SCAN_LIMIT``."""
    monkeypatch.setattr(local_index, "SCAN_LIMIT", SMALL_LIMIT)
    return Scans(local_mailbox)


def _truth(root: Path, prefix: str = "", start_after: str | None = None) -> list[str]:
    """What a listing must return, read from the directory itself."""
    keys = []
    for directory, _, files in os.walk(root):
        for name in files:
            key = os.path.relpath(os.path.join(directory, name), root).replace(os.sep, "/")
            if not any(part.startswith(".") for part in key.split("/")):
                keys.append(key)
    return sorted(k for k in keys if k.startswith(prefix) and (start_after is None or k > start_after))


def _run(script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def test_sorted_keys_against_a_list():
    keys = SortedKeys([f"k{i:05d}" for i in range(0, 5000, 2)])
    reference = sorted(f"k{i:05d}" for i in range(0, 5000, 2))
    for i in itertools.chain(range(1, 5000, 3), range(0, 300, 1)):
        key = f"k{i:05d}"
        if i % 5 == 0:
            assert keys.discard(key) == (key in reference)
            if key in reference:
                reference.remove(key)
        else:
            assert keys.add(key) == (key not in reference)
            if key not in reference:
                reference.append(key)
                reference.sort()
    assert len(keys) == len(reference)
    for after in [None, "", "k00000", "k00001", "k02500", "k04999", "k9", "a"]:
        for low in ["", "k01", "k03000"]:
            expected = [k for k in reference if k >= low and (after is None or k > after)]
            assert keys.page(after, low, 7) == expected[:7]
            assert keys.page(after, low, 10_000) == expected


def test_start_after_and_prefixes_from_the_index(local_mailbox, scans):
    names = [f"units/{i:04d}" for i in range(0, 60, 3)] + ["units/a/b", "units/a-b", "units0", "run.json", "work/x/1"]
    for name in names:
        local_mailbox.put(name, b"v")
    assert list(local_mailbox.list("units/")) == _truth(local_mailbox.path, "units/")
    assert list(local_mailbox.list()) == _truth(local_mailbox.path)
    built = scans.mark()
    for prefix in ["", "units/", "units", "units/00", "units/a", "work/", "zzz/", "units/a/"]:
        for start_after in [None, "", "units/", "units/0003", "units/0004", "units/a", "units/a-b", "units/zz", "v"]:
            expected = _truth(local_mailbox.path, prefix, start_after)
            assert list(local_mailbox.list(prefix, start_after)) == expected, (prefix, start_after)
    assert not {"units", ""} & scans.since(built)  # both served from the index


_CREATOR = """
import sys
from gradientmail import LocalMailbox, MailboxError
box = LocalMailbox(sys.argv[1])
for i in range(int(sys.argv[2])):
    key = f"units/{i:05d}-{sys.argv[3]}"
    box.put_if_absent(key, b"claim")
    if i % 7 == 0:
        box.put_if_absent(f"units/{i:05d}-shared", sys.argv[3].encode())  # a race with the others
    if i % 11 == 0:
        box.delete(f"units/{i:05d}-{sys.argv[3]}")
        print("-" + key, flush=True)
    else:
        print("+" + key, flush=True)
"""


def test_listings_see_every_key_created_before_they_started(local_mailbox, scans):
    (local_mailbox.path / "units").mkdir()
    for i in range(2000):  # more keys than the writers change: never cheaper to read them all again
        (local_mailbox.path / "units" / f"{i:05d}-before").write_bytes(b"v")
    assert len(list(local_mailbox.list("units/"))) == 2000
    built = scans.mark()
    writers = [_run(_CREATOR, str(local_mailbox.path), "400", name) for name in ("a", "b")]
    reported: dict[str, bool] = {}
    try:
        streams = [writer.stdout for writer in writers]
        for round_ in itertools.count():
            # What the writers reported before this listing started must be exactly as reported.
            progressed = False
            for stream in streams:
                for _ in range(5):
                    line = stream.readline()
                    if not line:
                        break
                    progressed = True
                    reported[line[1:].strip()] = line[0] == "+"
            listed = set(local_mailbox.list("units/", "units/00000-before" if round_ % 2 else None))
            for key, present in reported.items():
                if key > "units/00000-before" or round_ % 2 == 0:
                    assert (key in listed) == present, (key, present)
            if not progressed:
                break
    finally:
        for writer in writers:
            writer.wait(timeout=120)
    assert all(writer.returncode == 0 for writer in writers)
    assert list(local_mailbox.list("units/")) == _truth(local_mailbox.path, "units/")
    assert list(local_mailbox.list()) == _truth(local_mailbox.path)
    assert "units" not in scans.since(built)  # every listing of units/ came from the index


_KILLED_AFTER_LINK = """
import os, sys
from gradientmail import LocalMailbox, MailboxError
real_link, real_unlink = os.link, os.unlink
def link(*args, **kwargs):
    real_link(*args, **kwargs)
    print("linked", flush=True)
    sys.stdin.read()  # blocks until the parent kills this process, before "=" is recorded
def unlink(*args, **kwargs):
    real_unlink(*args, **kwargs)
    if kwargs.get("dir_fd") is not None and args[0] == "victim":
        print("unlinked", flush=True)
        sys.stdin.read()
os.link, os.unlink = link, unlink
box = LocalMailbox(sys.argv[1])
if sys.argv[2] == "create":
    box.put_if_absent("units/victim", b"claim")
else:
    box.delete("units/victim")
"""


@pytest.mark.parametrize("change", ["create", "delete"])
def test_a_writer_killed_mid_change_is_listed_as_the_directory_is(local_mailbox, scans, change):
    for i in range(SMALL_LIMIT * 2):
        local_mailbox.put_if_absent(f"units/{i:05d}", b"v")
    if change == "delete":
        local_mailbox.put_if_absent("units/victim", b"v")
    before = list(local_mailbox.list("units/"))
    assert ("units/victim" in before) == (change == "delete")
    built = scans.mark()
    child = _run(_KILLED_AFTER_LINK, str(local_mailbox.path), change)
    try:
        assert child.stdout.readline() == ("linked\n" if change == "create" else "unlinked\n")
    finally:
        child.kill()
        child.wait(timeout=60)
    for _ in range(2):  # and still at the next listing: the change is never recorded as finished
        assert list(local_mailbox.list("units/")) == _truth(local_mailbox.path, "units/")
        assert ("units/victim" in list(local_mailbox.list("units/", "units/00010"))) == (change == "create")
    assert "units" not in scans.since(built)


def test_keys_created_during_a_listing(local_mailbox, scans, monkeypatch):
    monkeypatch.setattr(local_index, "_PAGE", 10)  # the listing copies 10 keys at a time
    for i in range(0, 200, 2):
        local_mailbox.put_if_absent(f"units/{i:04d}", b"v")
    list(local_mailbox.list("units/"))
    listing = local_mailbox.list("units/")
    first = list(itertools.islice(listing, 35))
    child = subprocess.run(
        [sys.executable, "-c", _CREATE_SOME, str(local_mailbox.path)], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr
    first += list(itertools.islice(listing, 5))
    assert list(local_mailbox.list("units/", "units/0150")) == [
        "units/0151",
        *(f"units/{i:04d}" for i in range(152, 200, 2)),
    ]
    rest = list(listing)  # the index changed under this listing
    keys = first + rest
    assert keys == sorted(set(keys))  # in order, none twice
    throughout = {f"units/{i:04d}" for i in range(0, 200, 2)} - {"units/0100"}
    assert throughout <= set(keys)  # every key present all along is listed
    assert "units/0151" in keys and "units/0100" not in keys  # ahead of the cursor: as it is now
    assert "units/0001" not in keys  # behind it: not
    assert list(local_mailbox.list("units/")) == _truth(local_mailbox.path, "units/")


_CREATE_SOME = """
import sys
from gradientmail import LocalMailbox, MailboxError
box = LocalMailbox(sys.argv[1])
box.put_if_absent("units/0001", b"v")
box.put_if_absent("units/0151", b"v")
box.delete("units/0100")
"""


def test_entries_made_by_hand_are_listed_after_the_next_full_scan(local_mailbox, scans, monkeypatch):
    for i in range(SMALL_LIMIT * 2):
        local_mailbox.put_if_absent(f"units/{i:05d}", b"v")
    list(local_mailbox.list("units/"))
    (local_mailbox.path / "units" / "by-hand").write_bytes(b"v")
    built = scans.mark()
    assert "units/by-hand" not in list(local_mailbox.list("units/"))  # the index does not know it yet
    assert scans.since(built) == set()
    monkeypatch.setattr(local_index, "REBUILD_MIN_S", 0.0)
    monkeypatch.setattr(local_index, "REBUILD_FACTOR", 0.0)
    assert "units/by-hand" in list(local_mailbox.list("units/"))
    assert scans.since(built) == {"units"}


def test_the_journal_holds_a_record_before_and_after_each_change(local_mailbox):
    local_mailbox.put_if_absent("units/a", b"v")
    local_mailbox.put_if_absent("units/a", b"again")  # no change: nothing recorded
    local_mailbox.put("units/b", b"v")
    local_mailbox.delete("units/a")
    local_mailbox.delete("units/missing")  # no change
    journals = list((local_mailbox.path / local_index.INDEX_DIR).iterdir())
    assert len(journals) == 1 and journals[0].name.endswith(".log")
    assert journals[0].read_text().splitlines() == [
        "?units/a",
        "=units/a",
        "?units/b",
        "=units/b",
        "?units/a",
        "=units/a",
    ]
    assert list(local_mailbox.list()) == ["units/b"]  # .index is never listed


@pytest.mark.parametrize("planted", ["symlink", "file"])
def test_a_planted_journal_directory_is_refused_and_listings_read_the_directory(
    local_mailbox, scans, tmp_path, planted
):
    for i in range(SMALL_LIMIT * 2):
        local_mailbox.put_if_absent(f"units/{i:05d}", b"v")
    list(local_mailbox.list("units/"))
    index = local_mailbox.path / local_index.INDEX_DIR
    for journal in index.iterdir():
        journal.unlink()
    index.rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if planted == "symlink":
        index.symlink_to(elsewhere, target_is_directory=True)
    else:
        index.write_bytes(b"not a directory")
    with pytest.raises(MailboxError, match="symbolic link" if planted == "symlink" else "not the journal directory"):
        local_mailbox.put_if_absent("units/new", b"v")
    assert list(elsewhere.iterdir()) == []  # nothing written through the link
    assert not (local_mailbox.path / "units" / "new").exists()  # a change that cannot be recorded is not made
    (local_mailbox.path / "units" / "by-hand").write_bytes(b"v")
    built = scans.mark()
    assert "units/by-hand" in list(local_mailbox.list("units/"))  # no journal to trust: read whole
    assert scans.since(built) == {"units"}


def _forked_child(box: LocalMailbox, results) -> None:
    results.put(list(box.list("units/")))
    box.put_if_absent("units/from-child", b"v")
    results.put(list(box.list("units/")))


def test_a_forked_child_starts_its_own_index(local_mailbox, scans):
    import multiprocessing

    for i in range(SMALL_LIMIT * 2):
        local_mailbox.put_if_absent(f"units/{i:05d}", b"v")
    before = list(local_mailbox.list("units/"))
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_forked_child, args=(local_mailbox, results))
    child.start()
    try:
        assert results.get(timeout=120) == before
        assert results.get(timeout=120) == sorted([*before, "units/from-child"])
    finally:
        child.join(timeout=120)
    assert child.exitcode == 0
    assert list(local_mailbox.list("units/")) == sorted([*before, "units/from-child"])  # from the journal


_ONE_CHANGE = """
import sys
from gradientmail import LocalMailbox
box = LocalMailbox(sys.argv[1])
if sys.argv[2] == "create":
    box.put_if_absent(sys.argv[3], b"v")
else:
    box.delete(sys.argv[3])
"""


@pytest.mark.parametrize("rewrite", ["truncated", "rewritten"])
def test_a_journal_truncated_or_rewritten_in_place_is_not_trusted(local_mailbox, scans, rewrite):
    """The journal cut to nothing (or rewritten to its old size) under a live lister: its next
    records start below where the lister had read, and were skipped until the index went stale
    (about 10 s of listings without the new key, or with a deleted one)."""
    for i in range(SMALL_LIMIT * 2):
        local_mailbox.put_if_absent(f"units/{i:05d}", b"v")
    assert len(list(local_mailbox.list("units/"))) == SMALL_LIMIT * 2  # the index is built
    (journal,) = (local_mailbox.path / local_index.INDEX_DIR).iterdir()
    size = journal.stat().st_size
    os.truncate(journal, 0)  # in place: the same inode
    for change, key in (("create", "units/new"), ("delete", "units/00003")):
        subprocess.run([sys.executable, "-c", _ONE_CHANGE, str(local_mailbox.path), change, key], check=True)
    if rewrite == "rewritten":  # and then grown past where the lister had read
        with open(journal, "ab") as handle:
            handle.write(b"\n" * size)
    listed = list(local_mailbox.list("units/"))
    assert listed == _truth(local_mailbox.path, "units/"), "a key created and a key deleted since"
    assert "units/new" in listed and "units/00003" not in listed
