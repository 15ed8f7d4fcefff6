"""S3Mailbox through a real fault-injecting HTTP proxy in front of moto's server.

Bodies cut off mid-way, connections reset or stalled, outages shorter and longer than the retry
window, and an endpoint that never answers. Every fault is decided
per request by the test's rule (``s3_fault_proxy``), never by timing.
"""

from __future__ import annotations

import datetime
import pickle
import socket

import pytest

pytest.importorskip("boto3")

from queue_nodes import NodeSpec, run_nodes  # noqa: E402
from s3_fault_proxy import (  # noqa: E402
    BREAK,
    DENIED,
    DROP,
    LOST,
    PASS,
    PRECONDITION,
    STALL,
    TRUNCATE,
    FaultProxy,
    Request,
)

from gradientmail import MailboxError, UnsafeStoreError, open_mailbox  # noqa: E402
from gradientmail.mailbox import s3_retry  # noqa: E402
from gradientmail.mailbox.s3 import S3Mailbox
from gradientmail.mailbox.s3_retry import DEFAULT_RETRY_WINDOW, FIRST_CONTACT_ATTEMPTS, RetryBudget

pytestmark = pytest.mark.timeout(90)

VALUE = bytes(range(256)) * 256  # 64 KiB: half of it is surely on the wire when the cut comes


@pytest.fixture(autouse=True)
def no_botocore_sleep(monkeypatch):
    """botocore's own backoff sleeps up to seconds per retry; the retries themselves stay."""
    from botocore.retries.standard import ExponentialBackoff

    monkeypatch.setattr(ExponentialBackoff, "delay_amount", lambda self, context: 0)


@pytest.fixture
def proxy(s3_endpoint):
    with FaultProxy(s3_endpoint) as proxy:
        yield proxy


def through(endpoint: str, bucket: str, *, botocore_attempts: int = 1, read_timeout=None, **options) -> S3Mailbox:
    """A mailbox at ``endpoint``; with one botocore attempt each request is one loop round."""
    config: dict = {"retries": {"mode": "standard", "total_max_attempts": botocore_attempts}}
    if read_timeout is not None:
        config["read_timeout"] = read_timeout
    options.setdefault("backoff", 0.001)
    return S3Mailbox(bucket, "run", endpoint_url=endpoint, config=config, **options)


def object_get(key: str):
    return lambda request: request.method == "GET" and request.path.endswith(f"/run/{key}")


def is_listing(request: Request) -> bool:
    return request.method == "GET" and "list-type=2" in request.query


def first(count: int, action: str, match=lambda request: True):
    """A rule: ``action`` for the first ``count`` requests that ``match``, then pass."""
    seen = [0]

    def rule(request: Request) -> str:
        if not match(request) or seen[0] >= count:
            return PASS
        seen[0] += 1
        return action

    return rule


def count_sends(mailbox: S3Mailbox) -> list[int]:
    """A counter of HTTP attempts (botocore's included), refused connections too."""
    sent = [0]

    def hook(**_):
        sent[0] += 1

    mailbox.client.meta.events.register("before-send.s3.*", hook)
    return sent


def closed_port() -> int:
    with socket.socket() as sock:  # nobody listens on it once closed: connection refused
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- item 1: a body cut off mid-way is retried like any transient fault -----------------------
@pytest.mark.slow
@pytest.mark.parametrize("fault", [TRUNCATE, BREAK, STALL])
@pytest.mark.parametrize("operation", ["get", "get_versioned"])
def test_broken_get_body_is_retried(proxy, s3_bucket, operation, fault):
    mailbox = through(proxy.url, s3_bucket, read_timeout=0.5 if fault == STALL else None)
    mailbox.put("k", VALUE)
    proxy.rule = first(1, fault, object_get("k"))
    found = getattr(mailbox, operation)("k")
    assert (found if operation == "get" else found[0]) == VALUE
    assert proxy.faults == 1


@pytest.mark.slow
def test_broken_bodies_past_the_retries_raise_mailbox_error(proxy, s3_bucket):
    mailbox = through(proxy.url, s3_bucket, max_attempts=3)
    mailbox.put("k", VALUE)
    proxy.rule = lambda request: TRUNCATE if object_get("k")(request) else PASS
    with pytest.raises(MailboxError) as caught:
        mailbox.get("k")
    assert (caught.value.operation, caught.value.key) == ("get", "k")
    assert proxy.url in str(caught.value) and "after 3 attempts" in str(caught.value)
    assert "IncompleteRead" in str(caught.value)
    assert proxy.faults == 3


@pytest.mark.slow
def test_cut_listing_pages_and_error_bodies(proxy, s3_bucket):
    """A cut listing page or error body is retried like any other failure: botocore turns an
    unparseable page into a 500, and an error body cut short still carries its status."""
    mailbox = through(proxy.url, s3_bucket)
    mailbox.put("k", b"v")
    proxy.rule = first(1, TRUNCATE, is_listing)
    assert list(mailbox.list()) == ["k"] and proxy.faults == 1
    proxy.rule = first(1, TRUNCATE)  # the 412 of a lost create
    assert mailbox.put_if_absent("k", b"other") is False and proxy.faults == 2
    proxy.rule = first(1, TRUNCATE)  # the 404 of a missing key
    assert mailbox.get("missing") is None and proxy.faults == 3


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_claims_survive_cut_bodies_across_node_processes(tmp_path, proxy, s3_bucket):
    """Every third body a node reads (claim read-backs, run.json) is cut off mid-way; two node
    processes still train every unit exactly once."""
    from queue_nodes import check_exactly_once

    from gradientmail import unit_grid

    proxy.rule = lambda request: (
        TRUNCATE if request.method == "GET" and not is_listing(request) and request.number % 3 == 0 else PASS
    )
    mailbox = S3Mailbox(s3_bucket, "runs/queue", endpoint_url=proxy.url, backoff=0.01)
    units = unit_grid(steps=8, unit_steps=1, lanes=2)
    names = {unit.first * 2 + unit.lane: ident for ident, unit in units.items()}
    specs = [  # node-0 with a DataLoader worker process, node-1 on its own thread
        NodeSpec(mailbox, f"node-{rank}", units, str(tmp_path), workers=1 - rank, prefetch=2, names=names)
        for rank in range(2)
    ]
    run_nodes(specs, isolated=True, timeout=100)
    check_exactly_once(mailbox, tmp_path, units, lambda unit: [unit.first])
    assert proxy.faults > 0


# -- item 2: a retry window that rides out outages; fail fast when never answered -------------
@pytest.mark.slow
def test_outage_inside_the_default_window_is_ridden_out(proxy, s3_bucket, s3_endpoint):
    """The write lands but its answer is lost, then 40 connections in a row are dropped (more
    than the 6 rounds the mailbox used to allow); the claim is still won exactly once."""
    mailbox = through(proxy.url, s3_bucket, backoff=0)  # default retry_window
    assert mailbox.retry_window == DEFAULT_RETRY_WINDOW
    mailbox.put("hello", b"")  # the endpoint has answered: what follows is an outage
    outage = [LOST] + [DROP] * 40
    proxy.rule = lambda request: outage.pop(0) if outage else PASS
    assert mailbox.put_if_absent("units/1", b"mine") is True
    assert proxy.faults == 41
    rival = through(s3_endpoint, s3_bucket)
    assert rival.put_if_absent("units/1", b"theirs") is False
    assert rival.get("units/1") == b"mine"


@pytest.mark.slow
def test_outage_longer_than_the_window_names_endpoint_and_cause(proxy, s3_bucket):
    mailbox = through(proxy.url, s3_bucket, backoff=0.01, retry_window=datetime.timedelta(seconds=1))
    mailbox.put("hello", b"")
    proxy.rule = lambda request: DROP
    with pytest.raises(MailboxError) as caught:
        mailbox.put_if_absent("units/1", b"mine")
    message = str(caught.value)
    assert (caught.value.operation, caught.value.key) == ("put_if_absent", "units/1")
    assert f"endpoint {proxy.url} is unreachable or breaking connections" in message
    assert any(cause in message for cause in ("Connection reset by peer", "Remote end closed"))
    assert "retry_window=0:00:01" in message
    assert "never answered" not in message
    assert "whether the write landed is unknown" in message


@pytest.mark.slow
def test_refused_after_answering_is_an_outage_not_a_wrong_address(s3_endpoint, s3_bucket):
    with FaultProxy(s3_endpoint) as proxy:
        mailbox = through(proxy.url, s3_bucket, backoff=0.01, retry_window=datetime.timedelta(seconds=2))
        mailbox.put("hello", b"")
    sent = count_sends(mailbox)  # the proxy is gone: every connection is refused now
    with pytest.raises(MailboxError) as caught:
        mailbox.get("hello")
    assert "Connection refused" in str(caught.value) and "never answered" not in str(caught.value)
    assert sent[0] > FIRST_CONTACT_ATTEMPTS, "an outage is retried for the whole window"


def test_never_answering_endpoint_fails_fast(s3_bucket):
    from queue_nodes import RecordingLoad, named_units

    from gradientmail.patterns.shared_queue import shared_queue

    endpoint = f"http://127.0.0.1:{closed_port()}"
    mailbox = through(endpoint, s3_bucket, backoff=0.01, retry_window=datetime.timedelta(hours=1))
    sent = count_sends(mailbox)
    with pytest.raises(MailboxError) as caught:
        with shared_queue(
            named_units(2), mailbox=mailbox, learner_id="a", load=RecordingLoad("/nonexistent", "a"), workers=0
        ) as batches:
            list(batches)
    message = str(caught.value)
    assert (caught.value.operation, caught.value.key) == ("put_if_absent", "run.json")
    assert f"endpoint {endpoint} is unreachable (Connection refused) and has never answered" in message
    assert "reading back" not in message
    assert sent[0] == FIRST_CONTACT_ATTEMPTS  # not an hour of retries


def test_backoff_is_capped_exponential_with_jitter_within_the_window(monkeypatch):
    clock = [1000.0]
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        clock[0] += seconds

    monkeypatch.setattr(s3_retry.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(s3_retry.time, "sleep", sleep)
    budget = RetryBudget(window=60.0, backoff=0.5)
    while budget.spend():
        pass
    assert sum(sleeps) == pytest.approx(60.0), "retries go on until the window is spent, no more"
    for failure, slept in enumerate(sleeps[:-1]):
        assert 0 <= slept <= min(s3_retry.MAX_BACKOFF, 0.5 * 2**failure)
    assert len(set(sleeps)) > 1, "jittered"
    assert len(sleeps) > 12, "capped: the window holds many retries, not a few huge sleeps"


def test_retry_window_is_an_option_of_open_mailbox(s3_bucket):
    window = datetime.timedelta(seconds=30)
    mailbox = open_mailbox(f"s3://{s3_bucket}/run", retry_window=window)
    assert isinstance(mailbox, S3Mailbox) and mailbox.retry_window == window
    assert pickle.loads(pickle.dumps(mailbox)).retry_window == window
    assert S3Mailbox(s3_bucket).retry_window == DEFAULT_RETRY_WINDOW == datetime.timedelta(minutes=2)
    with pytest.raises(TypeError, match="timedelta"):
        S3Mailbox(s3_bucket, retry_window=120)
    with pytest.raises(ValueError, match="negative"):
        S3Mailbox(s3_bucket, retry_window=datetime.timedelta(seconds=-1))


@pytest.mark.slow
def test_workers_inherit_that_the_endpoint_answered(proxy, s3_bucket):
    mailbox = through(proxy.url, s3_bucket)
    assert pickle.loads(pickle.dumps(mailbox)).answered is False
    mailbox.put("hello", b"")
    assert pickle.loads(pickle.dumps(mailbox)).answered is True


@pytest.mark.parametrize("url", ["https://minio.example.com:9000/runs/exp-7", "http://host/b/r"])
def test_web_urls_are_refused_with_the_likely_intended_call(url):
    with pytest.raises(UnsafeStoreError) as caught:
        open_mailbox(url)
    message = str(caught.value)
    assert "http/https" not in message and message.startswith(f"{url}: ")
    assert "s3://" in message and "endpoint_url=" in message


def radosgw_if_match(request: Request) -> str:
    """Ceph's radosgw (16.2): a quoted ``If-Match`` ETag never matches; a bare one does."""
    tag = request.header("If-Match")
    return PRECONDITION if tag is not None and tag.startswith('"') else PASS


def test_replace_if_wins_on_a_store_that_takes_if_match_etags_only_bare(proxy, s3_bucket):
    box = through(proxy.url, s3_bucket)
    box.put("lease", b"v1")
    proxy.rule = radosgw_if_match
    _, version = box.get_versioned("lease")
    assert version.startswith('"')  # as GetObject returns it
    assert box.replace_if("lease", b"v2", version)  # refused quoted, then taken bare
    assert box.get("lease") == b"v2"
    assert not box.replace_if("lease", b"v3", version)  # a stale ETag still loses, bare or not
    _, version = box.get_versioned("lease")
    requests = proxy.requests
    assert box.replace_if("lease", b"v4", version)  # from now on bare at once: one request
    assert proxy.requests == requests + 1 and box.get("lease") == b"v4"


def test_replace_if_loses_once_when_the_object_really_changed(proxy, s3_bucket):
    box = through(proxy.url, s3_bucket)
    box.put("lease", b"v1")
    _, version = box.get_versioned("lease")
    box.put("lease", b"changed")
    assert not box.replace_if("lease", b"v2", version)
    assert box.get("lease") == b"changed"


# -- a refusal that hides a missing bucket -----------------------------------
def is_object_request(request: Request) -> bool:
    return "/run/" in request.path


def test_a_refused_write_to_a_missing_bucket_names_the_missing_bucket(proxy):
    """A store that answers 403 AccessDenied for a missing bucket was reported as rejected
    credentials, while ``status`` (a listing) said NoSuchBucket; one HeadBucket tells them apart."""
    proxy.rule = lambda request: DENIED if is_object_request(request) else PASS
    mailbox = through(proxy.url, "gm-no-such-bucket-403")
    with pytest.raises(MailboxError, match="'gm-no-such-bucket-403' does not exist at this endpoint") as caught:
        mailbox.put_if_absent("units/1", b"x")
    assert "AccessDenied" in str(caught.value) and "credentials were rejected" not in str(caught.value)


def test_a_refused_write_to_an_existing_bucket_still_names_the_credentials(proxy, s3_bucket):
    proxy.rule = lambda request: DENIED if is_object_request(request) else PASS
    mailbox = through(proxy.url, s3_bucket)
    with pytest.raises(MailboxError, match="credentials were rejected or lack permission"):
        mailbox.put_if_absent("units/1", b"x")
