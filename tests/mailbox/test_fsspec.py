"""FsspecMailbox: only filesystems with a verified atomic create are accepted, and those work."""

from __future__ import annotations

import functools
import multiprocessing
import os

import pytest

fsspec = pytest.importorskip("fsspec")

from fsspec.implementations.dirfs import DirFileSystem  # noqa: E402
from fsspec.implementations.local import LocalFileSystem  # noqa: E402
from fsspec.implementations.memory import MemoryFileSystem  # noqa: E402
from fsspec.spec import AbstractFileSystem  # noqa: E402

from gradientmail import MailboxError, UnsafeStoreError, open_mailbox  # noqa: E402
from gradientmail.mailbox.filesystem import ATOMIC_CREATE, FsspecMailbox  # noqa: E402
from gradientmail.mailbox.s3_common import TOKEN_METADATA  # noqa: E402


class _LocalSubclass(LocalFileSystem):
    """Could override _open; only the exact, verified classes are trusted."""


class _FakeGCS(AbstractFileSystem):
    protocol = ("gs", "gcs")


class _FakeFTP(AbstractFileSystem):
    protocol = "ftp"


def test_allow_list_is_exactly_what_was_verified():
    assert set(ATOMIC_CREATE) == {
        "fsspec.implementations.local.LocalFileSystem",
        "s3fs.core.S3FileSystem",
    }


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda root: MemoryFileSystem(), "open_mailbox\\('memory://name'\\)"),
        (lambda root: DirFileSystem(path=str(root), fs=LocalFileSystem()), "checks and then"),
        (lambda root: _LocalSubclass(), "has not verified"),
        (lambda root: _FakeGCS(), "gcsfs .* not verified it yet"),
        (lambda root: _FakeFTP(), "pipe_file\\(mode='create'\\)"),
    ],
    ids=["memory", "dir-wrapper", "local-subclass", "gcs", "other"],
)
def test_unverified_filesystems_are_refused(tmp_path, make, message):
    root = tmp_path / "mailbox"
    with pytest.raises(UnsafeStoreError, match=message):
        FsspecMailbox(make(tmp_path), str(root))
    assert not root.exists()  # refused before anything was written


@pytest.mark.parametrize("url", ["memory://x", "gs://bucket/run", "gcs://bucket", "abfs://c/run", "az://c"])
def test_unverified_urls_are_refused_without_importing(url):
    with pytest.raises(UnsafeStoreError):
        FsspecMailbox.from_url(url)


def test_open_mailbox_routes_other_protocols_to_fsspec(tmp_path):
    with pytest.raises(UnsafeStoreError, match="has not verified"):
        open_mailbox("http://127.0.0.1:1/run")  # HTTPFileSystem: no atomic create


def test_local_filesystem_uses_the_link_technique(tmp_path):
    mailbox = FsspecMailbox(LocalFileSystem(), str(tmp_path / "box"))
    assert mailbox.put_if_absent("units/1", b"whole")
    assert mailbox.put_if_absent("units/1", b"other") is False
    assert os.stat(tmp_path / "box" / "units" / "1").st_nlink == 1  # the temp link is gone
    assert [p.name for p in (tmp_path / "box" / "units").iterdir()] == ["1"]
    assert mailbox.url == (tmp_path / "box").as_uri()


# -- s3fs ------------------------------------------------------------------------------------
s3fs = pytest.importorskip("s3fs")


@pytest.fixture
def private_fs(s3_endpoint):
    """An s3fs instance of its own, so that patching its client cannot leak into other tests."""
    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True)
    fs.connect()
    return fs


def test_s3fs_refuses_empty_values(s3_bucket, s3_endpoint, s3_client):
    mailbox = FsspecMailbox.from_url(f"s3://{s3_bucket}/run", endpoint_url=s3_endpoint)
    with pytest.raises(ValueError, match="touch"):
        mailbox.put_if_absent("units/1", b"")
    assert s3_client.list_objects_v2(Bucket=s3_bucket).get("KeyCount") == 0
    mailbox.put("progress/a", b"")  # an unconditional empty write is fine
    assert mailbox.get("progress/a") == b""


def test_s3fs_token_is_metadata(s3_bucket, s3_endpoint, s3_client):
    mailbox = FsspecMailbox.from_url(f"s3://{s3_bucket}/run", endpoint_url=s3_endpoint)
    assert mailbox.put_if_absent("units/1", b"exact")
    head = s3_client.head_object(Bucket=s3_bucket, Key="run/units/1")
    assert len(head["Metadata"][TOKEN_METADATA]) == 32


@pytest.mark.slow
def test_s3fs_own_retry_after_a_landed_write(s3_bucket, s3_endpoint, private_fs, monkeypatch):
    import botocore.exceptions

    client = private_fs.s3
    original = client.put_object
    calls = []

    @functools.wraps(original)  # s3fs filters arguments by the method's __name__
    async def lands_then_breaks(**kwargs):
        calls.append(kwargs.get("IfNoneMatch"))
        result = await original(**kwargs)
        if len(calls) == 1:  # s3fs retries this one itself; the retry meets our own object
            raise botocore.exceptions.ConnectionClosedError(endpoint_url=s3_endpoint)
        return result

    monkeypatch.setattr(client, "put_object", lands_then_breaks)
    mailbox = FsspecMailbox(private_fs, f"{s3_bucket}/run")
    rival = FsspecMailbox.from_url(f"s3://{s3_bucket}/run", endpoint_url=s3_endpoint)
    assert mailbox.put_if_absent("units/1", b"mine") is True
    assert calls == ["*", "*"]
    assert rival.put_if_absent("units/1", b"theirs") is False
    assert mailbox.put_if_absent("units/1", b"again") is False
    assert rival.get("units/1") == b"mine"


def test_s3fs_store_ignoring_if_none_match_is_refused(s3_bucket, private_fs, monkeypatch):
    client = private_fs.s3
    original = client.put_object

    @functools.wraps(original)
    async def ignores_condition(**kwargs):
        kwargs.pop("IfNoneMatch", None)
        return await original(**kwargs)

    monkeypatch.setattr(client, "put_object", ignores_condition)
    mailbox = FsspecMailbox(private_fs, f"{s3_bucket}/run")
    with pytest.raises(UnsafeStoreError, match="ignores conditional writes"):
        mailbox.verify()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_s3fs_multipart_create_is_conditional(s3_bucket, s3_endpoint, s3_client):
    part = 5 * 2**20
    mine = os.urandom(1024) * (2 * part // 1024 + 7)  # three parts
    theirs = bytes(reversed(mine))
    mailbox = FsspecMailbox.from_url(f"s3://{s3_bucket}/run", endpoint_url=s3_endpoint, block_size=part)
    assert mailbox.put_if_absent("big", mine) is True
    assert mailbox.put_if_absent("big", theirs) is False  # checked at CompleteMultipartUpload
    assert mailbox.get("big") == mine
    assert s3_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    head = s3_client.head_object(Bucket=s3_bucket, Key="run/big")
    assert TOKEN_METADATA in head["Metadata"]


def test_s3fs_missing_bucket_is_named(s3_endpoint):
    mailbox = FsspecMailbox.from_url("s3://gm-no-such-bucket/run", endpoint_url=s3_endpoint)
    with pytest.raises(MailboxError, match="'gm-no-such-bucket' does not exist"):
        mailbox.get("k")
    with pytest.raises(MailboxError, match="does not exist"):
        mailbox.put_if_absent("k", b"v")


def test_old_s3fs_is_refused(s3_bucket, s3_endpoint, monkeypatch):
    monkeypatch.setattr(s3fs, "__version__", "2024.12.0")
    with pytest.raises(UnsafeStoreError, match="s3fs>=2025.7"):
        FsspecMailbox.from_url(f"s3://{s3_bucket}/run", endpoint_url=s3_endpoint)


def test_s3fs_filesystem_rebuilt_in_a_new_process(s3_bucket, s3_endpoint):
    mailbox = FsspecMailbox.from_url(f"s3://{s3_bucket}/run", endpoint_url=s3_endpoint)
    mailbox.put("k", b"v")
    filesystem = mailbox.filesystem
    context = multiprocessing.get_context("fork")  # as a DataLoader worker is made
    results = context.Queue()
    child = context.Process(target=lambda: results.put((mailbox.get("k"), mailbox.filesystem is not filesystem)))
    child.start()
    try:
        assert results.get(timeout=60) == (b"v", True)
    finally:
        child.join(timeout=10)
    assert mailbox.filesystem is filesystem and mailbox.get("k") == b"v"


def test_a_web_filesystem_is_refused_naming_its_url_once():
    from fsspec.implementations.http import HTTPFileSystem

    with pytest.raises(UnsafeStoreError) as info:
        FsspecMailbox(HTTPFileSystem(), "https://example.com/run")
    message = str(info.value)
    assert message.startswith("https://example.com/run: ") and "https://https://" not in message
