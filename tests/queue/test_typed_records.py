"""Typed records (``ClaimRecord`` and one class per record) and one liveness verdict.

The claim's bytes on the store must not change: ``to_bytes`` gives exactly what ``claim_body``
wrote before, a read-and-rewrite keeps every field and its place, and a bad record is refused
as before. The queue (``LeaseWatch``) and ``gradientmail status`` (``RunReader``) must agree on
a lease's state for the same record and clock.
"""

from __future__ import annotations

import json
import time

import pytest

from gradientmail import RecordError
from gradientmail.layout import claim_key
from gradientmail.mailbox.memory import MemoryMailbox
from gradientmail.queue import claims
from gradientmail.queue.claims import claim_body, load_claim, parse_claim
from gradientmail.queue.liveness import LeaseWatch
from gradientmail.records import (
    MAX_RECORD_BYTES,
    STOPPED,
    ClaimRecord,
    DoneRecord,
    LeaseRecord,
    MemberRecord,
    PresenceRecord,
    ProgressRecord,
    RunRecord,
    WorkRecord,
)
from gradientmail.status import Claim, RunReader, read_run
from gradientmail.verdict import EXPIRED, LIVE, Sightings, judge_lease

NESTED = b"[" * 50_000 + b"]" * 50_000


@pytest.fixture
def fixed_claims(monkeypatch):
    """``claim_body`` with a fixed host, pid and clock, so its bytes can be written down."""
    monkeypatch.setattr(claims, "host_name", lambda: "host-1")
    monkeypatch.setattr(claims.os, "getpid", lambda: 4242)
    monkeypatch.setattr(claims.time, "time", lambda: 1700000000.25)


def test_claim_body_bytes_are_unchanged(fixed_claims):
    assert claim_body("node-0", "t0") == (
        b'{"learner":"node-0","token":"t0","host":"host-1","pid":4242,"worker":null,"claimed_at":1700000000.25}'
    )
    assert claim_body("node-1", "t1", 3, incarnation="i1", state="active") == (
        b'{"learner":"node-1","token":"t1","host":"host-1","pid":4242,"worker":3,'
        b'"claimed_at":1700000000.25,"incarnation":"i1","state":"active"}'
    )


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"incarnation": "i", "state": "active"},
        {"incarnation": "i", "state": "active", "step": None, "position": None, "taken_from": "old"},
        {"incarnation": "i", "state": "released", "step": -3, "position": 7, "released_at": 1.5e9},
    ],
)
def test_claim_bytes_round_trip_byte_for_byte(extra):
    body = claim_body("node-0", "tok", worker=1, **extra)
    record = ClaimRecord.from_bytes(body)
    assert record.to_bytes() == body
    # The old dict reading, dumped the old way, gives the same bytes too.
    assert json.dumps(parse_claim(body), separators=(",", ":")).encode() == body
    assert (record.learner, record.token, record.worker) == ("node-0", "tok", 1)
    assert record.state == extra.get("state") and record.incarnation == extra.get("incarnation")


def test_rewrite_keeps_unknown_fields_and_their_order():
    body = b'{"state":"active","learner":"a","future":{"x":[1]},"token":"t","step":4}'
    record = ClaimRecord.from_bytes(body)
    assert record.to_bytes() == body
    released = record.replace(state="released", step=5, released_at=2.0)
    old_way = json.loads(body)
    old_way.update(state="released", step=5, released_at=2.0)  # what release() did to the dict
    assert released.to_bytes() == json.dumps(old_way, separators=(",", ":")).encode()
    assert record.state == "active", "replace returns a copy"


def test_status_claim_is_built_from_the_record():
    body = claim_body("node-2", "t", worker=None, incarnation="inc", state="released")
    claim = read_run(_box_with(claim_key("u7"), body)).claims[0]
    record = ClaimRecord.from_bytes(body)
    assert claim == Claim.from_record("u7", record)
    assert (claim.learner, claim.host, claim.pid, claim.state, claim.incarnation) == (
        "node-2",
        record.host,
        record.pid,
        "released",
        "inc",
    )
    assert claim.stream == ("node-2", record.host, record.pid, None)


@pytest.mark.parametrize(
    "data",
    [
        NESTED,
        b" " * (MAX_RECORD_BYTES + 1),
        b"not json",
        b"[1, 2]",
        b'{"token": "t"}',  # no learner
        b'{"learner": ".."}',  # not one key segment
        b'{"learner": "a", "pid": true}',
        b'{"learner": "a", "claimed_at": NaN}',
    ],
)
def test_a_bad_claim_is_refused_as_before(data):
    with pytest.raises(RecordError):
        ClaimRecord.from_bytes(data)
    assert load_claim(data) is None and parse_claim(data) is None
    run = read_run(_box_with(claim_key("bad"), data))
    assert [c.learner for c in run.claims] == ["?"]
    assert [u.key for u in run.unreadable] == ["units/bad"]


# -- one lease judgement ---------------------------------------------------------------------
def _lease(state="running", written=None, lease_s=0.2, incarnation="i") -> bytes:
    return json.dumps(
        {
            "learner": "node-A",
            "incarnation": incarnation,
            "beat": 1,
            "consumed": 0,
            "time": time.time() if written is None else written,
            "lease_s": lease_s,
            "state": state,
        }
    ).encode()


def _box_with(key: str, data: bytes) -> MemoryMailbox:
    box = MemoryMailbox(f"claim-record-{time.monotonic_ns()}")
    box.put(key, data)
    return box


def _both(record: bytes) -> tuple[list[str | None], list[bool]]:
    """The status tool's and the queue's verdicts on ``record``: read now, and after a lease."""
    box = _box_with("leases/node-A.json", record)
    now = [100.0]  # one fake monotonic clock for both readers: no sleeping
    reader, watch = RunReader(box, clock=lambda: now[0]), LeaseWatch(0.2, clock=lambda: now[0])
    shown, expired = [], []
    for _ in range(2):
        shown.append(reader.read().learner("node-A").lease)
        expired.append(watch.expired("node-A", record))
        now[0] += 0.25
    return shown, expired


@pytest.mark.parametrize(
    "record, verdicts",
    [
        (_lease(state="stopped"), [STOPPED, STOPPED]),
        # A writer clock an hour ahead: only the record standing still can expire it.
        (_lease(written=time.time() + 3600), [LIVE, EXPIRED]),
    ],
    ids=["stopped", "writer-clock-an-hour-ahead"],  # stable names: the records hold times
)
def test_status_and_queue_agree_on_a_lease(record, verdicts):
    shown, expired = _both(record)
    assert shown == verdicts
    assert expired == [verdict != LIVE for verdict in verdicts]


def test_status_also_trusts_the_writers_clock():
    """Documented in docs/cli.md: status also expires a lease by its writer's ``time``."""
    box = _box_with("leases/node-A.json", _lease(written=time.time() - 60))
    assert read_run(box).learner("node-A").lease == EXPIRED
    assert LeaseWatch(0.2).expired("node-A", _lease(written=time.time() - 60)) is False  # first sight


def test_an_unusable_lease_is_still_skipped():
    box = _box_with("leases/node-A.json", NESTED)
    run = read_run(box)
    assert run.learner("node-A").lease is None and [u.key for u in run.unreadable] == ["leases/node-A.json"]
    assert LeaseWatch(1.0).expired("node-A", NESTED) is False  # a record that never changes, first seen


def test_judge_lease_rules():
    running = LeaseRecord({"state": "running", "incarnation": "i", "time": 100.0})
    stopped = running.replace(state="stopped")
    assert judge_lease(running, 5.0) == LIVE
    assert judge_lease(stopped, 5.0) == STOPPED
    assert judge_lease(running, 5.0, incarnation="j") == EXPIRED
    assert judge_lease(running, 5.0, now=105.0) == LIVE and judge_lease(running, 5.0, now=105.5) == EXPIRED
    assert judge_lease(running, 5.0, now=150.0, stale_s=60.0) == LIVE, "stale_s: the writer's clock's own bound"
    assert judge_lease(running, 5.0, now=161.0, stale_s=60.0) == EXPIRED
    assert judge_lease(None, 5.0, unchanged_s=lambda: 5.0) == EXPIRED
    asked = []
    judge_lease(stopped, 5.0, unchanged_s=lambda: asked.append(1) or 0.0)
    assert not asked, "the standing-still clock is asked only when the record leaves it live"


def test_a_presence_record_is_judged_by_the_same_verdict():
    record = PresenceRecord.new("node-0", "i", "running", 1, 10.0, {"host": "h"}, pid=1, pid_start=None, now=100.0)
    assert judge_lease(record, 30.0, now=120.0) == LIVE
    assert judge_lease(record.replace(state="stopped"), 30.0) == STOPPED
    assert judge_lease(record, 30.0, unchanged_s=lambda: 30.0) == EXPIRED


WRITTEN = {
    WorkRecord: lambda: WorkRecord.new("n", "t", "i", -3, position=2),
    DoneRecord: lambda: DoneRecord.new("n", "t"),
    LeaseRecord: lambda: LeaseRecord.new("n", "i", 2, 5, 30.0, "running"),
    PresenceRecord: lambda: PresenceRecord.new("n", "i", "running", 1, 10.0, {"host": "h"}, pid=7, pid_start=3),
    RunRecord: lambda: RunRecord.new(4, None),
    MemberRecord: lambda: MemberRecord.new("n", 1.7e9),
    ProgressRecord: lambda: ProgressRecord.new({"learner": "n", "steps": 3}, units=2, samples_in_run=9),
}


@pytest.mark.parametrize("record", list(WRITTEN), ids=lambda record: record.__name__)
def test_every_record_reads_back_what_its_writer_wrote(record):
    """Each record's writer (``new``) and reader (``from_bytes``) live in one class and agree;
    the reader is bounded like every other (``records.parse``) and refuses another kind's body."""
    data = WRITTEN[record]().to_bytes()
    read = record.from_bytes(data)
    assert read.to_bytes() == data and type(read) is record
    assert record.read(None) is None and record.read(b"[]") is None
    with pytest.raises(RecordError, match="more than a record may hold"):
        record.from_bytes(b" " * (MAX_RECORD_BYTES + 1))


def test_a_presence_record_is_refused_like_any_record():
    """Presence records are parsed by the same bounded reader: a field of the wrong type or a
    missing required field is refused (the Presence warns and overwrites it)."""
    good = PresenceRecord.new("n", "i", "running", 1, 10.0, {"host": "h"}, pid=7, pid_start=None).to_bytes()
    assert PresenceRecord.from_bytes(good).pid == 7
    for bad in (b'{"incarnation": "i", "state": "running", "host": "h", "pid": true}', b'{"state": "running"}'):
        with pytest.raises(RecordError):
            PresenceRecord.from_bytes(bad)


def test_sightings_count_from_the_first_sight_of_a_content():
    now = [0.0]
    seen = Sightings(lambda: now[0])
    assert seen.unchanged_s("a", b"x") == 0.0
    now[0] = 3.0
    assert seen.unchanged_s("a", b"x") == 3.0
    assert seen.unchanged_s("a", b"y") == 0.0 and seen.unchanged_s("b", None) == 0.0
