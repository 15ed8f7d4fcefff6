"""Shared fixtures: a real HTTP S3 endpoint (moto's server on 127.0.0.1) and fresh mailboxes.

``any_mailbox`` runs a test once per backend (the conformance suite uses it; any test that only
needs "a mailbox" can too). ``mailbox_factory(backend, run)`` opens further mailboxes: the same
``run`` gives the same store, another ``run`` an isolated one (another directory, memory name or
run prefix in the same bucket).
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable, Iterator
from typing import Any

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

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one log line per request otherwise
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


@pytest.fixture(scope="session")
def s3_client(s3_endpoint: str) -> Any:
    """A plain boto3 client of the moto server, for arranging and inspecting buckets."""
    import boto3

    return boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")


@pytest.fixture
def s3_bucket(s3_client: Any) -> str:
    """A fresh, empty bucket on the moto server."""
    name = f"gm-{uuid.uuid4().hex[:12]}"
    s3_client.create_bucket(Bucket=name)
    return name


@pytest.fixture
def local_mailbox(tmp_path) -> LocalMailbox:
    return LocalMailbox(tmp_path / "mailbox")


@pytest.fixture
def memory_mailbox() -> Iterator[MemoryMailbox]:
    mailbox = MemoryMailbox(f"test-{uuid.uuid4().hex}")
    yield mailbox
    mailbox.clear()


MAILBOX_BACKENDS = ("local", "memory", "s3", "fsspec-local", "fsspec-s3")
"""Every backend of the conformance suite: directory, in-process, boto3 S3, fsspec on local disk
and s3fs, the last two S3 ones against the same moto server."""


@pytest.fixture
def mailbox_factory(request, tmp_path) -> Iterator[Callable[..., Any]]:
    """``factory(backend, run="run")`` → a mailbox; the S3 server starts only when needed."""
    memory: list[MemoryMailbox] = []
    token = uuid.uuid4().hex[:8]

    def factory(backend: str, run: str = "run") -> Any:
        if backend == "local":
            return LocalMailbox(tmp_path / "local" / run)
        if backend == "memory":
            mailbox = MemoryMailbox(f"test-{token}-{run}")
            memory.append(mailbox)
            return mailbox
        if backend == "s3":
            from gradientmail.mailbox.s3 import S3Mailbox

            endpoint = request.getfixturevalue("s3_endpoint")
            bucket = request.getfixturevalue("s3_bucket")
            return S3Mailbox(bucket, run, endpoint_url=endpoint, backoff=0.01)
        if backend == "fsspec-local":
            pytest.importorskip("fsspec")
            from gradientmail.mailbox.filesystem import FsspecMailbox

            return FsspecMailbox.from_url((tmp_path / "fsspec" / run).as_uri())
        if backend == "fsspec-s3":
            pytest.importorskip("s3fs")
            from gradientmail.mailbox.filesystem import FsspecMailbox

            endpoint = request.getfixturevalue("s3_endpoint")
            bucket = request.getfixturevalue("s3_bucket")
            return FsspecMailbox.from_url(f"s3://{bucket}/{run}", endpoint_url=endpoint)
        raise ValueError(f"unknown backend {backend!r}")

    yield factory
    for mailbox in memory:
        mailbox.clear()


@pytest.fixture(params=MAILBOX_BACKENDS)
def mailbox_backend(request) -> str:
    return request.param


@pytest.fixture
def any_mailbox(mailbox_backend: str, mailbox_factory) -> Any:
    """A fresh, empty mailbox of each backend in turn."""
    return mailbox_factory(mailbox_backend)
