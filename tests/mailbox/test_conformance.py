"""Each mailbox backend joins the conformance suite (``conformance.py``) by subclassing it."""

from __future__ import annotations

import pytest
from conformance import MailboxConformance  # tests/mailbox/ is on sys.path while its tests run


class TestLocalMailbox(MailboxConformance):
    backend = "local"


class TestMemoryMailbox(MailboxConformance):
    backend = "memory"


class TestFsspecOnLocalDisk(MailboxConformance):
    backend = "fsspec-local"


@pytest.mark.slow
class TestS3MailboxOnMoto(MailboxConformance):
    backend = "s3"


@pytest.mark.slow
class TestFsspecOnMoto(MailboxConformance):
    backend = "fsspec-s3"


@pytest.mark.slow
class TestS3MailboxOnSeaweedFS(MailboxConformance):
    backend = "s3-seaweedfs"


@pytest.mark.slow
class TestS3MailboxOnRadosgw(MailboxConformance):
    backend = "s3-radosgw"
