"""Each mailbox backend joins the conformance suite (``gradientmail.testing``) by subclassing it.

``mailbox_factory`` (tests/conftest.py) opens the backends named here; the hooks say what this
repository's stores need: moto filled in-process, S3 list requests and the bytes of GetObject
answers counted through boto3's events (moto's server runs in this process, so its memory would
count too), the S3 servers' endpoints for reopening, SeaweedFS's known listing deviation.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gradientmail.testing import MailboxConformance

SEAWEEDFS_LISTS_BY_DIRECTORY = (
    "SeaweedFS (4.48) lists a filer directory walk, not whole keys in byte order: ``a/b`` comes "
    "before ``a-b``, and ``start_after='a-b'`` skips ``a/...``. Flat names (claims, session "
    "versions) list in order; where names nest, a claimer only makes a claim attempt that the store "
    "then refuses (412): exactly-once holds."
)


def answered_bytes(client: Any) -> Callable[[], int]:
    """The bytes the GetObject answers to ``client`` carried from now on (their Content-Length):
    what a read took from the store, whatever the client then kept."""
    carried = [0]

    def count(http_response: Any, **kwargs: Any) -> None:
        carried[0] += int(http_response.headers.get("Content-Length") or 0)

    client.meta.events.register("after-call.s3.GetObject", count)
    return lambda: carried[0]


class S3Conformance(MailboxConformance):
    """The S3 backends: list requests and answered bytes counted, the endpoint passed when reopening."""

    server_fixture = "s3_endpoint"

    def count_list_requests(self, mailbox: Any) -> list[int] | None:
        calls: list[int] = []
        mailbox.client.meta.events.register("before-send.s3.ListObjectsV2", lambda **kwargs: calls.append(1))
        return calls

    @pytest.fixture
    def read_meter(self) -> Callable[[Any], Callable[[], int]]:
        return lambda mailbox: answered_bytes(mailbox.client)

    @pytest.fixture
    def reopen_options(self, request: pytest.FixtureRequest) -> dict[str, Any]:
        return {"endpoint_url": request.getfixturevalue(self.server_fixture)}


def fill_moto(mailbox: Any, bucket: str, prefix: str, keys: list[str]) -> bool:
    """Create ``keys`` straight in moto's in-process store (1,000 HTTP PUTs take ~10 s)."""
    try:
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.s3.models import s3_backends

        store = s3_backends[DEFAULT_ACCOUNT_ID]["global"]
        for key in keys:
            store.put_object(bucket, prefix + key, b"v")
        return True
    except (ImportError, AttributeError, KeyError, TypeError):
        return False  # moto's internals moved: real requests


class TestLocalMailbox(MailboxConformance):
    backend = "local"

    def directory_of(self, mailbox: Any) -> Path | None:
        return Path(mailbox.path)


class TestMemoryMailbox(MailboxConformance):
    backend = "memory"


class TestFsspecOnLocalDisk(MailboxConformance):
    backend = "fsspec-local"

    def directory_of(self, mailbox: Any) -> Path | None:
        return Path(mailbox.root)


@pytest.mark.slow
class TestS3MailboxOnMoto(S3Conformance):
    backend = "s3"

    def fill_many(self, mailbox: Any, keys: Any) -> None:
        if not fill_moto(mailbox, mailbox.bucket, mailbox.prefix, list(keys)):
            super().fill_many(mailbox, keys)


@pytest.mark.slow
class TestFsspecOnMoto(MailboxConformance):
    backend = "fsspec-s3"
    empty_create_refused = True  # s3fs would commit an empty "xb" file through touch(), unconditionally

    def fill_many(self, mailbox: Any, keys: Any) -> None:
        bucket, _, prefix = mailbox.root.partition("/")  # an s3fs root is "bucket/prefix"
        if not fill_moto(mailbox, bucket, prefix + "/" if prefix else "", list(keys)):
            super().fill_many(mailbox, keys)

    @pytest.fixture
    def reopen_options(self, s3_endpoint: str) -> dict[str, Any]:
        return {"endpoint_url": s3_endpoint}

    @pytest.fixture
    def read_meter(self) -> Callable[[Any], Callable[[], int]]:
        return lambda mailbox: answered_bytes(mailbox.filesystem.s3)  # s3fs's aiobotocore client


@pytest.mark.slow
class TestS3MailboxOnSeaweedFS(S3Conformance):
    backend = "s3-seaweedfs"
    server_fixture = "seaweedfs_endpoint"
    known_deviations = {
        "test_list_is_lexicographic": SEAWEEDFS_LISTS_BY_DIRECTORY,
        "test_list_start_after": SEAWEEDFS_LISTS_BY_DIRECTORY,
    }


@pytest.mark.slow
class TestS3MailboxOnRadosgw(S3Conformance):
    backend = "s3-radosgw"
    server_fixture = "radosgw_endpoint"
