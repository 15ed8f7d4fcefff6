"""open_mailbox: URL dispatch, install hints; LocalMailbox specifics; the wrappers."""

from __future__ import annotations

import pickle
import re
import sys
from pathlib import Path

import pytest

from gradientmail import (
    KeyConflictError,
    LocalMailbox,
    MailboxError,
    MemoryMailbox,
    MissingExtraError,
    open_mailbox,
)
from gradientmail.mailbox.wrappers import CountingMailbox, DelayedMailbox, FaultyMailbox


def test_paths_and_file_urls_open_local_mailboxes(tmp_path, monkeypatch):
    absolute = open_mailbox(str(tmp_path / "a"))
    assert isinstance(absolute, LocalMailbox) and absolute.path == tmp_path / "a"
    assert open_mailbox(tmp_path / "b").path == tmp_path / "b"  # os.PathLike
    assert open_mailbox((tmp_path / "c d").as_uri()).path == tmp_path / "c d"  # %20 decoded
    assert open_mailbox(f"file://{tmp_path}/e").path == tmp_path / "e"
    monkeypatch.chdir(tmp_path)
    assert open_mailbox("./rel").path == tmp_path / "rel"
    with pytest.raises(FileNotFoundError):
        open_mailbox(str(tmp_path / "missing"), create=False)


def test_a_home_relative_path_opens_in_the_home_directory(tmp_path, monkeypatch):
    """``~/runs/x`` is the user's home, as in a shell: no directory named ``~`` appears here."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert open_mailbox("~/runs/x").path == tmp_path / "home" / "runs" / "x"
    assert open_mailbox(Path("~/runs/y")).path == tmp_path / "home" / "runs" / "y"
    assert not (tmp_path / "~").exists()


def test_memory_urls():
    box = open_mailbox("memory://url-test")
    assert isinstance(box, MemoryMailbox) and box.name == "url-test"
    assert open_mailbox("memory://").name == "default"
    with pytest.raises(TypeError):
        open_mailbox("memory://x", endpoint_url="http://nowhere")
    box.clear()


def test_s3_url_with_endpoint(s3_bucket, s3_endpoint):
    from gradientmail.mailbox.s3 import S3Mailbox

    box = open_mailbox(f"s3://{s3_bucket}/runs/exp", endpoint_url=s3_endpoint, region_name="us-east-1")
    assert isinstance(box, S3Mailbox)
    assert (box.bucket, box.prefix, box.endpoint_url) == (s3_bucket, "runs/exp/", s3_endpoint)
    assert box.put_if_absent("k", b"v") and box.get("k") == b"v"
    assert open_mailbox(f"s3://{s3_bucket}", endpoint_url=s3_endpoint).prefix == ""


def test_s3fs_is_reachable_explicitly(s3_bucket, s3_endpoint):
    from gradientmail.mailbox.filesystem import FsspecMailbox

    box = FsspecMailbox.from_url(f"s3://{s3_bucket}/runs/exp", endpoint_url=s3_endpoint)
    assert box.url == f"s3://{s3_bucket}/runs/exp"
    assert box.put_if_absent("k", b"v") and box.get("k") == b"v"


def test_unknown_protocol():
    pytest.importorskip("fsspec")
    with pytest.raises(ValueError, match="not known"):
        open_mailbox("nosuchprotocol://bucket/run")


@pytest.mark.parametrize(
    "url, meant",
    [
        ("s3:/bucket/run", "s3://bucket/run"),
        ("s3:bucket/run", "s3://bucket/run"),
        ("S3:/bucket/run", "s3://bucket/run"),
        ("s3//bucket/run", "s3://bucket/run"),
        ("s3:///bucket/run", "s3://bucket/run"),
        ("s4://bucket/run", "s3://bucket/run"),
        ("memory:/x", "memory://x"),
        ("file:/data/run", "file:///data/run"),
        ("file://nas{tmp}/run", "file:///nas{tmp}/run"),  # a host would be dropped
    ],
)
def test_mistyped_urls_are_refused_with_the_likely_url(tmp_path, monkeypatch, url, meant):
    monkeypatch.chdir(tmp_path)
    url, meant = url.format(tmp=tmp_path), meant.format(tmp=tmp_path)
    with pytest.raises(ValueError, match=re.escape(f"did you mean {meant!r}?")) as caught:
        open_mailbox(url)
    assert repr(url) in str(caught.value)
    assert list(tmp_path.rglob("*")) == []  # no directory was created anywhere under here


def test_urls_from_pathlib_and_unknown_schemes_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="pathlib collapses"):
        open_mailbox(Path("s3://bucket/run"))  # Path made it 's3:/bucket/run'
    with pytest.raises(ValueError, match="unknown scheme 'xyz'"):
        open_mailbox("xyz:/data/run")
    pytest.importorskip("fsspec")
    with pytest.raises(ValueError, match=r"'xyz', which is not known") as caught:
        open_mailbox("xyz://bucket/run")
    assert "did you mean" not in str(caught.value)  # nothing close to suggest
    assert list(tmp_path.rglob("*")) == []


def test_schemes_are_case_insensitive_and_paths_stay_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert open_mailbox(f"FILE://{tmp_path}/a").path == tmp_path / "a"
    assert open_mailbox(f"file://localhost{tmp_path}/b").path == tmp_path / "b"
    assert open_mailbox("Memory://case").name == "case"
    assert open_mailbox("run:7").path == tmp_path / "run:7"  # a colon in a relative name
    assert open_mailbox("./s3:/x").path == tmp_path / "s3:" / "x"  # explicitly local
    assert open_mailbox(tmp_path / "s3:" / "y").path == tmp_path / "s3:" / "y"  # absolute
    pytest.importorskip("boto3")
    from gradientmail.mailbox.s3 import S3Mailbox

    box = open_mailbox("S3://bucket/run", endpoint_url="http://127.0.0.1:1")
    assert isinstance(box, S3Mailbox) and (box.bucket, box.prefix) == ("bucket", "run/")


@pytest.mark.parametrize("url", ["", None, 3])
def test_bad_urls(url):
    with pytest.raises(ValueError):
        open_mailbox(url)


def test_missing_boto3_names_the_extra(monkeypatch):
    for module in ("gradientmail.mailbox.s3", "gradientmail.mailbox.s3_client"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setitem(sys.modules, "boto3", None)  # "import boto3" now raises ImportError
    with pytest.raises(MissingExtraError, match=r"pip install 'gradientmail\[s3\]'") as caught:
        open_mailbox("s3://bucket/run")
    assert isinstance(caught.value, ImportError)


def test_missing_fsspec_names_the_extra(monkeypatch):
    monkeypatch.delitem(sys.modules, "gradientmail.mailbox.filesystem", raising=False)
    monkeypatch.setitem(sys.modules, "fsspec", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'gradientmail\[fsspec\]'"):
        open_mailbox("gs://bucket/run")


# -- LocalMailbox specifics ------------------------------------------------------------------
def test_local_key_and_directory_cannot_share_a_name(local_mailbox):
    local_mailbox.put("a/b", b"x")
    with pytest.raises(KeyConflictError):
        local_mailbox.put_if_absent("a", b"y")  # "a" is a directory of keys here
    with pytest.raises(KeyConflictError):
        local_mailbox.put("a", b"y")
    with pytest.raises(KeyConflictError):
        local_mailbox.put_if_absent("a/b/c", b"y")  # "a/b" is a key
    assert isinstance(KeyConflictError("m"), MailboxError)
    assert list(local_mailbox.list()) == ["a/b"]


def test_local_temporary_files_never_listed(local_mailbox):
    local_mailbox.put("units/1", b"x")
    (local_mailbox.path / "units" / ".1.abc.tmp").write_bytes(b"partial")
    assert list(local_mailbox.list()) == ["units/1"]


# -- wrappers --------------------------------------------------------------------------------
def test_counting_mailbox_counts_requests_and_pages(memory_mailbox):
    counting = CountingMailbox(memory_mailbox)
    for i in range(1500):
        counting.put(f"k/{i:04d}", b"v")
    assert counting.put_if_absent("k/0000", b"w") is False
    assert counting.get("k/0001") == b"v"
    counting.delete("k/0002")
    assert len(list(counting.list("k/"))) == 1499
    assert counting.counts == {"put": 1500, "put_if_absent": 1, "get": 1, "delete": 1, "list": 2}
    listing = counting.list()
    next(listing)
    assert counting.counts["list"] == 3  # lazily: one more page begun, not two
    assert counting.requests == 1506


def test_faulty_mailbox_injects_and_passes_through(memory_mailbox):
    def fault(operation, key):
        return OSError("injected") if key.startswith("bad") else None

    faulty = FaultyMailbox(memory_mailbox, fault)
    assert faulty.put_if_absent("good", b"v")
    with pytest.raises(OSError, match="injected"):
        faulty.put_if_absent("bad/1", b"v")
    assert memory_mailbox.get("bad/1") is None
    assert faulty.url == memory_mailbox.url


def test_delayed_mailbox_passes_through(tmp_path):
    delayed = DelayedMailbox(LocalMailbox(tmp_path), latency=0.0)
    assert delayed.put_if_absent("k", b"v") and delayed.get("k") == b"v"
    copy = pickle.loads(pickle.dumps(delayed))
    assert copy.get("k") == b"v" and copy.latency == 0.0
    with pytest.raises(ValueError):
        DelayedMailbox(delayed, latency=-1)
