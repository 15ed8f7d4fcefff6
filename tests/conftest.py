"""Shared fixtures: a real HTTP S3 endpoint (moto's server on 127.0.0.1) and fresh mailboxes."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator

import pytest

from gradientmail import LocalMailbox, MemoryMailbox

AWS_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """URL of moto's S3 server, real HTTP on 127.0.0.1, shared by the whole test session.

    Credentials are fake and exported to the environment so that child processes (nodes,
    DataLoader workers, the CLI) reach the same server through boto3's normal chain.
    """
    pytest.importorskip("moto.server")
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    saved = {name: os.environ.get(name) for name in AWS_TEST_ENV}
    os.environ.update(AWS_TEST_ENV)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """A fresh, empty bucket on the moto server."""
    import boto3

    name = f"gm-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


@pytest.fixture
def local_mailbox(tmp_path) -> LocalMailbox:
    return LocalMailbox(tmp_path / "mailbox")


@pytest.fixture
def memory_mailbox() -> Iterator[MemoryMailbox]:
    mailbox = MemoryMailbox(f"test-{uuid.uuid4().hex}")
    yield mailbox
    mailbox.clear()
