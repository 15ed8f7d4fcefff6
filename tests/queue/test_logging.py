"""The package logs through ``logging.getLogger("gradientmail")`` children and configures nothing."""

from __future__ import annotations

import datetime
import logging
import os
import warnings

import pytest
import torch

from gradientmail import MemoryMailbox, RecordSkippedWarning
from gradientmail.patterns.shared_queue import shared_queue
from gradientmail.records import ProgressRecord, SkippedRecords


def load_two(value: int):
    for step in range(2):
        yield value * 2 + step, torch.full((2,), float(value))


def messages(caplog, name: str, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == name and r.levelno == level]


def test_the_package_logger_has_a_null_handler_only():
    handlers = logging.getLogger("gradientmail").handlers
    assert handlers and all(isinstance(h, logging.NullHandler) for h in handlers)


def test_a_queue_logs_its_start_each_claim_and_its_end(caplog):
    caplog.set_level(logging.DEBUG, logger="gradientmail")
    box = MemoryMailbox(f"logging-{os.getpid()}-{id(caplog)}")
    units = {f"u{i}": i for i in range(3)}
    with shared_queue(
        units, mailbox=box, learner_id="node-L", load=load_two, workers=0, claim_ahead=0, resume=False
    ) as batches:
        taken = [step for step, _ in batches]
    assert sorted(taken) == list(range(6))

    info = messages(caplog, "gradientmail.queue", logging.INFO)
    start = [m for m in info if "shared queue on" in m]
    assert len(start) == 1
    assert "node-L" in start[0] and "3 units" in start[0] and "mode plain queue (resume=False)" in start[0]
    assert "memory://" in start[0]
    debug = messages(caplog, "gradientmail.queue", logging.DEBUG)
    assert sorted(m for m in debug if "claimed unit" in m) == [f"node-L claimed unit u{i}" for i in range(3)]
    assert sorted(m for m in debug if "loaded unit" in m) == [f"node-L loaded unit u{i} (2 batches)" for i in range(3)]
    assert any("claimed 3 units in 3 attempts: 0 conflicts" in m for m in info)
    end = [m for m in info if "left the shared queue" in m]
    assert len(end) == 1
    assert "6 batches of 3 units trained, 3 units claimed by this learner, 0 conflicts" in end[0]


def test_a_skipped_record_is_logged_a_warning_the_first_time(caplog):
    caplog.set_level(logging.DEBUG, logger="gradientmail")
    skipped = SkippedRecords("node-R")
    with pytest.warns(RecordSkippedWarning):
        assert skipped.read(ProgressRecord, b"not json", "progress/x.json", "x") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second one is not warned again...
        assert skipped.read(ProgressRecord, b"[1]", "progress/x.json", "x") is None
    warned = messages(caplog, "gradientmail.records", logging.WARNING)
    assert len(warned) == 1 and "progress/x.json" in warned[0] and "not JSON" in warned[0]
    assert len(messages(caplog, "gradientmail.records", logging.DEBUG)) == 1  # ...but logged


class _FlakyClient:
    """A boto3 client whose put_object fails ``failures`` times with a 503, then works."""

    meta = type("Meta", (), {"endpoint_url": "http://store.invalid"})

    def __init__(self, failures: int) -> None:
        self.failures = failures

    def put_object(self, **_):
        import botocore.exceptions

        if self.failures:
            self.failures -= 1
            raise botocore.exceptions.ClientError(
                {
                    "Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."},
                    "ResponseMetadata": {"HTTPStatusCode": 503},
                },
                "PutObject",
            )
        return {}


def test_s3_retries_warn_while_an_outage_is_ridden_out_and_say_when_it_ends(caplog):
    pytest.importorskip("boto3")
    from gradientmail.mailbox.s3 import S3Mailbox

    caplog.set_level(logging.DEBUG, logger="gradientmail")
    flaky = _FlakyClient(3)
    box = S3Mailbox(
        "bucket", "run", backoff=0.0, retry_window=datetime.timedelta(minutes=1), client_factory=lambda: flaky
    )
    box.put("progress/a.json", b"{}")
    records = [r for r in caplog.records if r.name == "gradientmail.mailbox"]
    levels = [r.levelno for r in records]
    assert levels == [logging.DEBUG, logging.WARNING, logging.DEBUG, logging.INFO]
    assert "SlowDown" in records[1].getMessage() and "retry_window=0:01:00" in records[1].getMessage()
    assert "put succeeded after 3 failed attempts" in records[3].getMessage()


def test_a_single_s3_retry_is_not_a_warning(caplog):
    pytest.importorskip("boto3")
    from gradientmail.mailbox.s3 import S3Mailbox

    caplog.set_level(logging.DEBUG, logger="gradientmail")
    flaky = _FlakyClient(1)
    box = S3Mailbox("bucket", "run", backoff=0.0, client_factory=lambda: flaky)
    box.put("progress/a.json", b"{}")
    levels = [r.levelno for r in caplog.records if r.name == "gradientmail.mailbox"]
    assert levels == [logging.DEBUG]
