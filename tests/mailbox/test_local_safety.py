"""LocalMailbox against hostile or broken directory contents and failing disks.

Symlinks, FIFOs and stray names are planted the way anyone with write access to the mailbox
could; the disk fills up through a real ``RLIMIT_FSIZE`` in a child process (and an injected
``ENOSPC``); a writer is SIGKILLed mid-write as a real process. Nothing depends on timing:
each child reports that it reached its point through a pipe before anything is checked.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gradientmail import LocalMailbox, MailboxError, MailSkippedWarning
from gradientmail.mailbox import local_temp

OPERATIONS = {
    "get": lambda box, key: box.get(key),
    "get_versioned": lambda box, key: box.get_versioned(key),
    "put": lambda box, key: box.put(key, b"evil"),
    "put_if_absent": lambda box, key: box.put_if_absent(key, b"evil"),
    "replace_if": lambda box, key: box.replace_if(key, b"evil", "0" * 64),
    "delete": lambda box, key: box.delete(key),
}


@pytest.fixture
def outside(tmp_path) -> Path:
    """A directory outside the mailbox holding a file nobody may read, change or delete."""
    directory = tmp_path / "outside"
    directory.mkdir()
    (directory / "secret").write_bytes(b"secret")
    return directory


def _untouched(outside: Path) -> None:
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]
    assert (outside / "secret").read_bytes() == b"secret"


def _hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


# -- item 5: never follow a symlink ----------------------------------------------------------
@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_a_symlinked_key_is_refused(local_mailbox, outside, operation):
    (local_mailbox.path / "progress").mkdir()
    (local_mailbox.path / "progress" / "node-a").symlink_to(outside / "secret")
    with pytest.raises(MailboxError, match=r"'progress/node-a'.*symbolic link") as caught:
        OPERATIONS[operation](local_mailbox, "progress/node-a")
    assert str(outside / "secret") in str(caught.value)  # where it points, for the operator
    assert (caught.value.key, caught.value.store) == ("progress/node-a", local_mailbox.url)
    _untouched(outside)
    assert (local_mailbox.path / "progress" / "node-a").is_symlink()


@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_a_symlinked_directory_is_never_entered(local_mailbox, outside, operation):
    (local_mailbox.path / "session").mkdir()
    (local_mailbox.path / "session" / "node-a").symlink_to(outside, target_is_directory=True)
    with pytest.raises(MailboxError, match=r"'session/node-a' is a symbolic link"):
        OPERATIONS[operation](local_mailbox, "session/node-a/secret")
    with pytest.raises(MailboxError, match="symbolic link"):
        OPERATIONS[operation](local_mailbox, "session/node-a/new")
    _untouched(outside)


def test_listing_skips_symlinks_with_a_warning(local_mailbox, outside):
    local_mailbox.put("session/node-b/000001", b"mail")
    (local_mailbox.path / "session" / "node-a").symlink_to(outside, target_is_directory=True)
    (local_mailbox.path / "session" / "node-c").symlink_to(outside / "secret")
    (local_mailbox.path / "session" / "node-d").symlink_to(outside / "missing")  # dangling
    for prefix in ["", "session/", "session/node"]:
        with pytest.warns(MailSkippedWarning) as caught:
            assert list(local_mailbox.list(prefix)) == ["session/node-b/000001"]
        assert sorted(str(w.message).split(" list skips ")[1][:16] for w in caught) == [
            "'session/node-a'",
            "'session/node-c'",
            "'session/node-d'",
        ]
        assert all("symbolic link" in str(w.message) for w in caught)
        assert {w.filename for w in caught} == {__file__}  # points at the caller of list()
    with pytest.warns(MailSkippedWarning, match=r"'session/node-a'.*symbolic link"):
        assert list(local_mailbox.list("session/node-a/")) == []  # not walked through
    _untouched(outside)


def test_a_symlinked_lock_directory_is_refused(local_mailbox, outside):
    local_mailbox.put("units/a", b"v1")
    _, version = local_mailbox.get_versioned("units/a")
    (local_mailbox.path / ".locks").symlink_to(outside, target_is_directory=True)
    with pytest.raises(MailboxError, match=r"'\.locks' is a symbolic link"):
        local_mailbox.replace_if("units/a", b"v2", version)
    _untouched(outside)
    assert local_mailbox.get("units/a") == b"v1"


def test_a_fifo_is_refused_without_hanging(local_mailbox):
    (local_mailbox.path / "units").mkdir()
    os.mkfifo(local_mailbox.path / "units" / "a")
    outcome: list[BaseException | bytes | None] = []

    def read() -> None:
        try:
            outcome.append(local_mailbox.get("units/a"))
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=60)  # a hang guard only: opening a FIFO to read blocks forever
    assert not reader.is_alive(), "get() blocked opening a FIFO"
    assert isinstance(outcome[0], MailboxError) and "FIFO" in str(outcome[0])
    with pytest.warns(MailSkippedWarning, match=r"'units/a'.*FIFO"):
        assert list(local_mailbox.list()) == []
    with pytest.raises(MailboxError, match="FIFO"):
        local_mailbox.put_if_absent("units/a", b"claim")


def test_names_that_are_not_keys_are_skipped_with_a_warning(local_mailbox):
    local_mailbox.put("units/a", b"v")
    (local_mailbox.path / "units" / "back\\slash").write_bytes(b"x")
    with pytest.warns(MailSkippedWarning, match="not a valid mailbox key"):
        assert list(local_mailbox.list()) == ["units/a"]


def test_a_symlinked_root_is_the_users_choice(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    box = LocalMailbox(tmp_path / "link")
    assert box.put_if_absent("units/a", b"v") and box.get("units/a") == b"v"
    assert list(box.list()) == ["units/a"]
    assert (tmp_path / "real" / "units" / "a").read_bytes() == b"v"


# -- item 9: failed writes leave nothing, dead writers' temp files are swept ------------------
WRITE_OPERATIONS = {
    "put": lambda box: box.put("units/a", b"x" * 100_000),
    "put_if_absent": lambda box: box.put_if_absent("units/a", b"x" * 100_000),
    "replace_if": lambda box: box.replace_if("units/a", b"x" * 100_000, box.get_versioned("units/a")[1]),
}


@pytest.mark.parametrize("operation", sorted(WRITE_OPERATIONS))
def test_a_full_disk_raises_mailbox_error_and_removes_the_temp_file(local_mailbox, monkeypatch, operation):
    if operation == "replace_if":
        local_mailbox.put("units/a", b"old")
    (local_mailbox.path / "units").mkdir(exist_ok=True)
    real_write = os.write

    def full_disk(fd: int, data) -> int:
        if len(data) <= 4096:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, bytes(data[:4096]))  # a partial write first, as a filling disk does

    with monkeypatch.context() as patch:
        patch.setattr(os, "write", full_disk)
        with pytest.raises(MailboxError) as caught:
            WRITE_OPERATIONS[operation](local_mailbox)
    error = caught.value
    assert "'units/a'" in str(error) and local_mailbox.url in str(error)
    assert "No space left on device" in str(error) and "full" in str(error)
    assert (error.operation, error.key, error.store) == (operation, "units/a", local_mailbox.url)
    assert isinstance(error.__cause__, OSError) and error.__cause__.errno == errno.ENOSPC
    assert _hidden(local_mailbox.path / "units") == []  # the temp file is gone
    expected = b"old" if operation == "replace_if" else None
    assert local_mailbox.get("units/a") == expected
    WRITE_OPERATIONS[operation](local_mailbox)  # space again: the next write works
    assert local_mailbox.get("units/a") == b"x" * 100_000


_FSIZE_CHILD = """
import json, resource, signal, sys
from gradientmail import LocalMailbox
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
box = LocalMailbox(sys.argv[1])
try:
    box.put_if_absent("units/a", b"x" * 65536)
    print(json.dumps({"raised": None}))
except Exception as exc:
    print(json.dumps({"raised": type(exc).__name__, "message": str(exc),
                      "key": getattr(exc, "key", None)}))
"""


def test_a_real_file_size_limit_leaves_no_temp_file(local_mailbox):
    (local_mailbox.path / "units").mkdir()
    child = subprocess.run(
        [sys.executable, "-c", _FSIZE_CHILD, str(local_mailbox.path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    report = json.loads(child.stdout)
    assert report["raised"] == "MailboxError", report
    assert report["key"] == "units/a" and "File too large" in report["message"]
    assert sorted(os.listdir(local_mailbox.path / "units")) == []  # no partial temp file
    assert local_mailbox.put_if_absent("units/a", b"claim")  # the unit is still claimable


_KILLED_CHILD = """
import os, sys
from gradientmail import LocalMailbox
real_write = os.write
def stall(fd, data):
    real_write(fd, bytes(data[: len(data) // 2]))  # half the value is on disk
    print("mid-write", flush=True)
    sys.stdin.read()  # blocks until the parent kills this process
os.write = stall
LocalMailbox(sys.argv[1]).put_if_absent("units/a", b"x" * 65536)
"""


def test_temp_files_of_writers_killed_mid_write_are_swept(local_mailbox):
    local_mailbox.put("units/b", b"v")
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_CHILD, str(local_mailbox.path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline() == "mid-write\n"
    finally:
        child.kill()
        child.wait(timeout=60)
    leftovers = _hidden(local_mailbox.path / "units")
    assert len(leftovers) == 1 and f".{child.pid}." in leftovers[0]  # its pid is in the name
    assert os.path.getsize(local_mailbox.path / "units" / leftovers[0]) == 32768
    assert list(local_mailbox.list("units/")) == ["units/b"]
    assert _hidden(local_mailbox.path / "units") == []  # swept by the listing
    assert local_mailbox.put_if_absent("units/a", b"claim")


def test_only_stale_temp_files_are_swept(local_mailbox):
    units = local_mailbox.path / "units"
    local_mailbox.put("units/b", b"v")
    live = local_temp.temp_name("a")  # this process: alive
    assert f".{local_temp.host_token()}.{os.getpid()}." in live
    other_host = f".a.{'f' * 12}.1234.{'0' * 32}.tmp"
    old_other_host = f".c.{'f' * 12}.1234.{'1' * 32}.tmp"
    old_format = f".d.{'2' * 32}.tmp"  # written before temp names carried their writer
    not_a_temp = ".notes"
    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead = f".e.{local_temp.host_token()}.{int(finished.stdout)}.{'3' * 32}.tmp"  # reaped
    for name in [live, other_host, old_other_host, old_format, not_a_temp, dead]:
        (units / name).write_bytes(b"partial")
    past = time.time() - local_temp.STALE_TEMP_SECONDS - 60
    for name in [old_other_host, old_format, not_a_temp]:
        os.utime(units / name, (past, past))
    assert list(local_mailbox.list()) == ["units/b"]
    assert _hidden(units) == sorted([live, other_host, not_a_temp])


def test_a_lister_whose_clock_runs_an_hour_ahead_sweeps_no_live_writer(local_mailbox, monkeypatch):
    """Temporary files are judged by their writer's process on this host, and by the store's
    clock for other hosts: a lister an hour ahead made 34-58 of 60 writers' puts fail."""
    units = local_mailbox.path / "units"
    local_mailbox.put("units/b", b"v")
    live = local_temp.temp_name("a")  # this process: alive
    other_host = f".c.{'f' * 12}.1234.{'1' * 32}.tmp"  # written just now on another host
    for name in (live, other_host):
        (units / name).write_bytes(b"partial")
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3700.0)
    assert list(local_mailbox.list()) == ["units/b"]
    assert _hidden(units) == sorted([live, other_host]), "neither file is an hour old by the store's clock"


def test_temp_names_fit_long_keys(local_mailbox):
    key = "units/" + "k" * 250  # a 250-byte name: the temp name must stay under NAME_MAX
    assert local_mailbox.put_if_absent(key, b"v") and local_mailbox.get(key) == b"v"
    local_mailbox.put(key, b"w")
    assert local_mailbox.get(key) == b"w"
