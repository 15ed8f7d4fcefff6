"""S3Mailbox against moto's HTTP server, with faults injected at the HTTP layer.

Faults come from botocore event hooks on the mailbox's own client: a ``before-send`` handler
either answers with a fake response (the request never reaches the server) or sends the request
for real and then reports a failure (the write landed, the client was told it did not). Races are
not tested here: moto's conditional write is check-then-write (see test_races.py).
"""

from __future__ import annotations

import multiprocessing
import pickle

import pytest

pytest.importorskip("boto3")

from botocore.awsrequest import AWSResponse  # noqa: E402
from botocore.httpsession import URLLib3Session  # noqa: E402

from gradientmail import MailboxError, UnsafeStoreError, open_mailbox  # noqa: E402
from gradientmail.errors import ValueTooLargeError  # noqa: E402
from gradientmail.mailbox.s3 import S3Mailbox
from gradientmail.mailbox.s3_common import TOKEN_METADATA  # noqa: E402


class _Body:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def stream(self, **_):
        yield self.data


def fake_response(request, status: int, code: str, message: str = "injected") -> AWSResponse:
    body = (
        f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{message}</Message></Error>"
    ).encode()
    return AWSResponse(request.url, status, {"Content-Type": "application/xml"}, _Body(body))


class Faults:
    """A ``before-send`` hook for one operation that follows a script, one entry per request.

    Entries: ``None`` (send normally), ``(status, code)`` (answer that, the request never
    arrives) or ``("landed", status, code)`` (send it for real, then answer that).
    Requests past the end of the script are sent normally.
    """

    def __init__(self, mailbox: S3Mailbox, operation: str, script, *, repeat_last: bool = False):
        self.script = list(script)
        self.repeat_last = repeat_last
        self.sent = 0
        self.http = URLLib3Session()
        mailbox.client.meta.events.register(f"before-send.s3.{operation}", self)

    def __call__(self, request, **_):
        index = self.sent
        self.sent += 1
        if index >= len(self.script):
            if not self.repeat_last:
                return None
            index = len(self.script) - 1
        step = self.script[index]
        if step is None:
            return None
        if step[0] == "landed":
            real = self.http.send(request)
            assert real.status_code == 200, real.content
            return fake_response(request, step[1], step[2])
        return fake_response(request, *step)


def make(bucket: str, endpoint: str, *, botocore_attempts: int = 3, **options) -> S3Mailbox:
    return S3Mailbox(
        bucket,
        "run",
        endpoint_url=endpoint,
        backoff=0,
        config={"retries": {"mode": "standard", "total_max_attempts": botocore_attempts}},
        **options,
    )


@pytest.fixture(autouse=True)
def no_botocore_sleep(monkeypatch):
    """botocore's own backoff sleeps up to seconds per retry; the retries themselves stay."""
    from botocore.retries.standard import ExponentialBackoff

    monkeypatch.setattr(ExponentialBackoff, "delay_amount", lambda self, context: 0)


@pytest.fixture
def mailbox(s3_bucket, s3_endpoint) -> S3Mailbox:
    return make(s3_bucket, s3_endpoint)


@pytest.fixture
def rival(s3_bucket, s3_endpoint) -> S3Mailbox:
    """Another node on the same bucket and run prefix, with its own client."""
    return make(s3_bucket, s3_endpoint)


# -- transient errors ------------------------------------------------------------------------
def test_transient_500s_are_retried_by_botocore(mailbox):
    faults = Faults(mailbox, "PutObject", [(500, "InternalError"), (500, "InternalError")])
    assert mailbox.put_if_absent("units/1", b"mine") is True
    assert faults.sent == 3
    assert mailbox.get("units/1") == b"mine"


def test_slow_down_then_success_through_own_loop(s3_bucket, s3_endpoint):
    mailbox = make(s3_bucket, s3_endpoint, botocore_attempts=1)  # only our loop retries
    faults = Faults(mailbox, "PutObject", [(503, "SlowDown")] * 3)
    assert mailbox.put_if_absent("units/1", b"mine") is True
    assert faults.sent == 4
    assert mailbox.put_if_absent("units/1", b"again") is False


def test_transient_errors_on_every_operation(s3_bucket, s3_endpoint):
    mailbox = make(s3_bucket, s3_endpoint, botocore_attempts=1)
    mailbox.put("k", b"v")
    for operation in ("GetObject", "ListObjectsV2", "DeleteObject", "PutObject"):
        Faults(mailbox, operation, [(503, "SlowDown"), (500, "InternalError")])
    assert mailbox.get("k") == b"v"
    assert list(mailbox.list()) == ["k"]
    mailbox.put("k", b"w")
    mailbox.delete("k")
    assert mailbox.get("k") is None


def test_persistent_failure_raises_mailbox_error(s3_bucket, s3_endpoint):
    mailbox = make(s3_bucket, s3_endpoint, botocore_attempts=1, max_attempts=3)
    faults = Faults(mailbox, "PutObject", [(500, "InternalError")], repeat_last=True)
    with pytest.raises(MailboxError) as caught:
        mailbox.put_if_absent("units/1", b"mine")
    assert faults.sent == 3
    error = caught.value
    assert (error.operation, error.key) == ("put_if_absent", "units/1")
    assert mailbox.url in error.store and "kept failing" in str(error)
    assert mailbox.get("units/1") is None
    error_copy = pickle.loads(pickle.dumps(error))  # errors cross process boundaries whole
    assert (error_copy.operation, error_copy.key) == (error.operation, error.key)
    assert str(error_copy) == str(error)


# -- ambiguous outcomes ----------------------------------------------------------------------
@pytest.mark.parametrize("botocore_attempts", [3, 1], ids=["botocore-retry", "own-loop"])
def test_ambiguous_put_that_landed_wins_exactly_once(s3_bucket, s3_endpoint, rival, botocore_attempts):
    mailbox = make(s3_bucket, s3_endpoint, botocore_attempts=botocore_attempts)
    heads = Faults(mailbox, "HeadObject", [])
    faults = Faults(mailbox, "PutObject", [("landed", 500, "InternalError")])
    # The retry meets our own object (412); the token read back says it is ours.
    assert mailbox.put_if_absent("units/1", b"mine") is True
    assert faults.sent == 2 and heads.sent == 1
    assert rival.put_if_absent("units/1", b"theirs") is False
    assert mailbox.put_if_absent("units/1", b"mine again") is False
    assert mailbox.get("units/1") == b"mine"  # the value is exactly the caller's bytes


def test_ambiguous_put_with_every_answer_an_error(s3_bucket, s3_endpoint, rival):
    mailbox = make(s3_bucket, s3_endpoint, botocore_attempts=1, max_attempts=3)
    faults = Faults(mailbox, "PutObject", [("landed", 500, "InternalError"), (503, "SlowDown")], repeat_last=True)
    assert mailbox.put_if_absent("units/1", b"mine") is True
    assert faults.sent == 3
    assert rival.put_if_absent("units/1", b"theirs") is False


def test_ambiguous_put_lost_to_a_rival(s3_bucket, s3_endpoint, rival):
    mailbox = make(s3_bucket, s3_endpoint)

    class RivalFirst(Faults):
        def __call__(self, request, **_):
            self.sent += 1
            if self.sent == 1:  # the rival creates the key while our request "fails"
                assert rival.put_if_absent("units/1", b"theirs") is True
                return fake_response(request, 500, "InternalError")
            return None

    RivalFirst(mailbox, "PutObject", [])
    assert mailbox.put_if_absent("units/1", b"mine") is False
    assert mailbox.get("units/1") == b"theirs"


@pytest.mark.slow
def test_plain_412_needs_no_read_back(mailbox, rival):
    assert rival.put_if_absent("units/1", b"theirs")
    heads = Faults(mailbox, "HeadObject", [])
    assert mailbox.put_if_absent("units/1", b"mine") is False
    assert heads.sent == 0


def test_token_is_metadata_not_body(mailbox, s3_client):
    assert mailbox.put_if_absent("units/1", b"exact")
    head = s3_client.head_object(Bucket=mailbox.bucket, Key="run/units/1")
    assert len(head["Metadata"][TOKEN_METADATA]) == 32
    assert s3_client.get_object(Bucket=mailbox.bucket, Key="run/units/1")["Body"].read() == b"exact"


# -- 409, unsupported and pretending stores --------------------------------------------------
def test_conditional_request_conflict_is_retried(mailbox):
    faults = Faults(mailbox, "PutObject", [(409, "ConditionalRequestConflict")] * 2)
    assert mailbox.put_if_absent("units/1", b"mine") is True
    assert faults.sent == 3  # botocore does not retry a 409; the mailbox's loop does
    assert mailbox.get("units/1") == b"mine"


def test_not_implemented_is_unsafe(mailbox):
    Faults(mailbox, "PutObject", [(501, "NotImplemented")], repeat_last=True)
    with pytest.raises(UnsafeStoreError, match="If-None-Match"):
        mailbox.put_if_absent("units/1", b"mine")
    with pytest.raises(UnsafeStoreError, match="conditional writes"):
        mailbox.verify()


def test_store_ignoring_if_none_match_is_refused_by_verify(mailbox):
    def strip(request, **_):
        if "If-None-Match" in request.headers:
            del request.headers["If-None-Match"]

    mailbox.client.meta.events.register("before-sign.s3.PutObject", strip)
    assert mailbox.put_if_absent("k", b"1") and mailbox.put_if_absent("k", b"2")  # the lie
    with pytest.raises(UnsafeStoreError, match="ignores conditional writes"):
        mailbox.verify()
    assert [key for key in mailbox.list() if key.startswith("_gradientmail")] == []


# -- bounded reads ---------------------------------------------------------------------------------
class GetObjectWatch:
    """What each GetObject of a mailbox asked for (its Range) and how many body bytes were read."""

    def __init__(self, mailbox: S3Mailbox) -> None:
        self.requests: list[tuple[str, str | None]] = []
        self.body_read = 0
        events = mailbox.client.meta.events
        events.register("before-send.s3", self._sent)
        events.register("after-call.s3.GetObject", self._answered)

    def _sent(self, request, event_name, **_):
        wanted = request.headers.get("Range")
        self.requests.append((event_name.rpartition(".")[2], wanted.decode() if isinstance(wanted, bytes) else wanted))

    def _answered(self, parsed, **_):
        body = parsed.get("Body")
        if body is None:
            return
        read = body.read

        def counted(amt=None):
            chunk = read(amt)
            self.body_read += len(chunk)
            return chunk

        body.read = counted


def ignore_range(mailbox: S3Mailbox) -> None:
    """The store ignores ``Range``: every GetObject answers with the whole object (200)."""

    def strip(request, **_):
        if "Range" in request.headers:
            del request.headers["Range"]

    mailbox.client.meta.events.register("before-sign.s3.GetObject", strip)


def test_a_bounded_get_is_one_ranged_request_and_a_long_body_is_never_read(mailbox):
    mailbox.put("big", bytes(2**20))
    watch = GetObjectWatch(mailbox)
    with pytest.raises(ValueTooLargeError) as caught:
        mailbox.get("big", max_bytes=1000)
    assert caught.value.size == 2**20  # from Content-Range
    assert watch.requests == [("GetObject", "bytes=0-1000")] and watch.body_read == 0  # no HEAD, no body
    assert mailbox.get_versioned("big", max_bytes=2**20) == mailbox.get_versioned("big")


def test_a_store_that_ignores_range_is_not_read_past_the_bound(mailbox):
    mailbox.put("big", bytes(2**20))
    mailbox.put("small", b"12345")
    ignore_range(mailbox)
    watch = GetObjectWatch(mailbox)
    with pytest.raises(ValueTooLargeError) as caught:
        mailbox.get("big", max_bytes=1000)
    assert caught.value.size == 2**20 and watch.body_read == 0  # refused by Content-Length, body unread
    assert mailbox.get("small", max_bytes=5) == b"12345" and mailbox.get("big", max_bytes=2**20) == bytes(2**20)


def test_an_answer_without_the_size_is_read_one_byte_past_the_bound_at_most(mailbox):
    mailbox.put("big", bytes(2**20))
    watch = GetObjectWatch(mailbox)

    def hide_total(parsed, **_):
        parsed["ContentRange"] = parsed["ContentRange"].rpartition("/")[0] + "/*"

    mailbox.client.meta.events.register("after-call.s3.GetObject", hide_total)
    with pytest.raises(ValueTooLargeError) as caught:
        mailbox.get("big", max_bytes=1000)
    assert caught.value.size is None and watch.body_read == 1001


def test_an_empty_object_is_read_plainly_after_the_range_is_refused(mailbox):
    mailbox.put("empty", b"")
    watch = GetObjectWatch(mailbox)
    assert mailbox.get_versioned("empty", max_bytes=10) == mailbox.get_versioned("empty")
    assert watch.requests[:2] == [("GetObject", "bytes=0-10"), ("GetObject", None)]  # 416, then plain


# -- configuration, credentials, errors ------------------------------------------------------
def test_missing_bucket_is_named(s3_endpoint):
    mailbox = S3Mailbox("gm-no-such-bucket", "run", endpoint_url=s3_endpoint, backoff=0)
    with pytest.raises(MailboxError, match="'gm-no-such-bucket' does not exist") as caught:
        mailbox.put_if_absent("units/1", b"x")
    assert caught.value.key == "units/1"
    with pytest.raises(MailboxError, match="does not exist"):
        list(mailbox.list())


def test_missing_credentials_are_named(s3_bucket, s3_endpoint, monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.delenv("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", raising=False)
    monkeypatch.delenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", raising=False)
    mailbox = S3Mailbox(s3_bucket, "run", endpoint_url=s3_endpoint, backoff=0)
    with pytest.raises(MailboxError, match="no usable AWS credentials") as caught:
        mailbox.get("units/1")
    assert caught.value.operation == "get"
    # An S3-compatible endpoint needs keys too, even one without authentication: say what to set.
    assert f"an S3-compatible store ({s3_endpoint}) needs them too" in str(caught.value)
    assert "any non-empty values" in str(caught.value)


def test_unknown_profile_is_named(s3_bucket, s3_endpoint):
    mailbox = S3Mailbox(s3_bucket, endpoint_url=s3_endpoint, profile_name="gm-no-such-profile")
    with pytest.raises(MailboxError, match="gm-no-such-profile"):
        mailbox.get("k")


def test_profile_supplies_credentials_and_endpoint(s3_bucket, s3_endpoint, monkeypatch, tmp_path):
    config = tmp_path / "config"
    config.write_text(
        "[profile gmtest]\n"
        "aws_access_key_id = fromprofile\naws_secret_access_key = fromprofile\n"
        f"region = us-east-1\nendpoint_url = {s3_endpoint}\n"
    )
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    mailbox = S3Mailbox(s3_bucket, "run", profile_name="gmtest")
    assert mailbox.put_if_absent("k", b"v")
    assert mailbox.client.meta.endpoint_url == s3_endpoint  # and the profile's keys signed the put


def test_aws_endpoint_url_is_honoured(s3_bucket, s3_endpoint, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    mailbox = open_mailbox(f"s3://{s3_bucket}/run")
    assert isinstance(mailbox, S3Mailbox) and mailbox.endpoint_url is None
    assert mailbox.put_if_absent("k", b"v") and mailbox.get("k") == b"v"
    assert mailbox.client.meta.endpoint_url == s3_endpoint


def test_prefix_normalisation_and_url(s3_bucket, s3_endpoint):
    assert S3Mailbox(s3_bucket, "runs/a").prefix == "runs/a/"
    assert S3Mailbox(s3_bucket, "runs/a/").url == f"s3://{s3_bucket}/runs/a"
    assert S3Mailbox(s3_bucket).prefix == "" and S3Mailbox(s3_bucket).url == f"s3://{s3_bucket}"
    for bad in ("/runs", "runs//a", "../x", "runs/./a"):
        with pytest.raises(ValueError):
            S3Mailbox(s3_bucket, bad)
    with pytest.raises(ValueError):
        S3Mailbox("", "run")
    with pytest.raises(ValueError):
        S3Mailbox("bucket/with/slash")


def test_list_skips_objects_that_are_not_keys(mailbox, s3_client):
    for name in ("run/units/", "run/units/.tmp", "run/a//b", "run/ok", "other/ok"):
        s3_client.put_object(Bucket=mailbox.bucket, Key=name, Body=b"")
    assert list(mailbox.list()) == ["ok"]


def test_client_is_per_process_and_not_pickled(mailbox):
    client = mailbox.client
    assert mailbox.client is client
    copy = pickle.loads(pickle.dumps(mailbox))
    assert copy.client is not client and copy.get("missing") is None
    assert _in_forked_child(lambda: mailbox.client is not client and mailbox.get("missing") is None)


def test_retry_settings_from_environment_are_honoured(s3_bucket, s3_endpoint, monkeypatch):
    default = S3Mailbox(s3_bucket, endpoint_url=s3_endpoint).client.meta.config.retries
    assert default == {"mode": "standard", "total_max_attempts": 3}
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "7")
    monkeypatch.setenv("AWS_RETRY_MODE", "adaptive")
    client = S3Mailbox(s3_bucket, endpoint_url=s3_endpoint).client
    assert client.meta.config.retries == {"mode": "adaptive", "total_max_attempts": 7}
    explicit = S3Mailbox(s3_bucket, endpoint_url=s3_endpoint, config={"retries": {"total_max_attempts": 2}})
    assert explicit.client.meta.config.retries["total_max_attempts"] == 2  # config= wins


def _in_forked_child(check) -> bool:
    """``check()`` run in a forked child process (as a DataLoader worker is made)."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=lambda: results.put(bool(check())))
    child.start()
    try:
        return results.get(timeout=60)
    finally:
        child.join(timeout=10)
