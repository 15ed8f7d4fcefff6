"""Every record read from the mailbox is bounded, validated, skipped if bad.

A claim, work record or lease that is not JSON, too large, nested too deep, or has a field of
the wrong type (a learner that is not one key segment) must never crash a node: it is counted
and skipped with one warning per kind and learner, and every other unit is still delivered
exactly once.
"""

from __future__ import annotations

import json
import os
import sys
import tracemalloc
import warnings
from datetime import timedelta

import pytest
import torch

from gradientmail import RecordError, RecordSkippedWarning, RunMismatchError
from gradientmail.layout import claim_key, learner_key, lease_key, work_key
from gradientmail.patterns.shared_queue import shared_queue
from gradientmail.queue.claims import parse_claim
from gradientmail.queue.elastic_options import ElasticOptions
from gradientmail.queue.liveness import LeaseWatch
from gradientmail.queue.progress import ProgressTracker
from gradientmail.queue.reclaim import ElasticClaimer
from gradientmail.queue.takeover import take_over
from gradientmail.records import (
    CLAIM,
    LEASE,
    MAX_DEPTH,
    MAX_RECORD_BYTES,
    PROGRESS,
    ClaimRecord,
    LeaseRecord,
    SkippedRecords,
    get_record,
    get_record_versioned,
    parse,
)
from gradientmail.run_record import prepare_mailbox

NESTED = b"[" * 50_000 + b"]" * 50_000  # within no bound; json.loads alone: RecursionError
DEEP_SMALL = b'{"learner": "x", "a": ' + b"[" * 3000 + b"]" * 3000 + b"}"  # under the size bound

BAD_CLAIMS = {
    "dot-dot learner": json.dumps({"learner": "..", "token": "t", "incarnation": "i", "state": "active"}).encode(),
    "nested learner": json.dumps({"learner": "a/b", "token": "t", "incarnation": "i", "state": "active"}).encode(),
    "deeply nested": DEEP_SMALL,
    "huge nested": NESTED,
    "not json": b"\x00\xffnot json",
    "NaN time": b'{"learner": "x", "token": "t", "claimed_at": NaN}',
    "list": b'["learner", "x"]',
}


def _body(**fields) -> bytes:
    return json.dumps(fields).encode()


# -- the parser ----------------------------------------------------------------------------------
REFUSED = [
    (NESTED, "more than a record may hold"),
    (DEEP_SMALL, f"nested deeper than {MAX_DEPTH}"),
    (b"x" * (MAX_RECORD_BYTES + 1), "more than a record may hold"),
    (b"\xff\xfe", "not JSON"),
    (b'{"learner": "x", "claimed_at": Infinity}', "Infinity is not JSON"),
    (b'{"learner": "x", "claimed_at": 1e400}', "'claimed_at' inf is not a unix time"),
    (b'{"learner": "x", "claimed_at": -1e300}', "is not a unix time"),
    (b'{"learner": "x", "pid": true}', "'pid' True is not an int"),
    (b'{"learner": "x", "pid": -1}', "'pid' -1 is outside"),
    (b'{"learner": "..", "token": "t"}', "'learner' '..' is not one mailbox key segment"),
    (b'{"learner": "a/b"}', "'learner' 'a/b' is not one mailbox key segment"),
    (b'{"learner": ""}', "not one mailbox key segment"),
    (b'{"learner": 7}', "'learner' is int, not a str"),
    (b'{"token": "t"}', "'learner' is missing"),
    (b'{"learner": "x", "state": "mine"}', "'state' 'mine' is not one of active, released"),
    (b"[1, 2]", "a JSON list, not an object"),
    (b'{"learner": "x", "pid": 1' + b"0" * 5000 + b"}", "not JSON"),
]


@pytest.mark.parametrize("data, problem", REFUSED, ids=[f"{i}-{p[:24]}" for i, (_, p) in enumerate(REFUSED)])
def test_bad_claims_are_refused_with_the_reason(data, problem):
    with pytest.raises(RecordError, match="claim 'units/u'") as caught:
        parse(CLAIM, data, "units/u")
    assert problem in str(caught.value)


def test_good_records_pass_and_keep_unknown_fields():
    body = _body(
        learner="node-1",
        token="t",
        host="h",
        pid=3,
        worker=None,
        claimed_at=1.7e9,
        state="released",
        step=-4,
        future_field=[1],
    )
    claim = parse(CLAIM, body)
    assert claim["learner"] == "node-1" and "future_field" not in claim  # unchecked: never handed out
    assert b'"future_field":[1]' in ClaimRecord.from_bytes(body).to_bytes()  # but kept for a rewrite
    brackets_in_text = _body(learner="n", token="[" * 200)  # brackets inside strings do not nest
    assert parse(CLAIM, brackets_in_text)["token"] == "[" * 200
    assert parse(PROGRESS, _body(learner="n", samples=7, units=None, finished=1.7e9))["samples"] == 7
    assert parse(LEASE, _body(incarnation="a", beat=1, time=0.0, state="running"))["beat"] == 1


def test_the_depth_check_is_linear_whatever_the_bytes():
    """64 KiB of escaped quotes with no closing quote took 16 s of CPU (a regex rescanning from
    every quote); a bound on the work, not a timing: the scanner visits each byte once, so such a
    record is refused in about the time plain text of that size takes."""
    import timeit

    from gradientmail.records import loads_object

    nasty = b'{"x":"' + b'\\"' * 30000 + b"{" * (MAX_DEPTH + 5)  # every bracket inside the open string
    flat = b'{"x":"' + b"ab" * 30000 + b"{" * (MAX_DEPTH + 5)
    deep = b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1)
    with pytest.raises(RecordError, match="nested deeper"):
        loads_object(deep)

    def fastest(data: bytes) -> float:
        """The fastest of three refusals: one time slice lost to a busy machine decides nothing."""

        def refuse() -> None:
            with pytest.raises(RecordError, match="not JSON"):
                loads_object(data)

        return min(timeit.repeat(refuse, number=1, repeat=3))

    # Escaped quotes cost about what plain text costs (quadratic: about 3,000 times more).
    assert fastest(nasty) < 100 * max(fastest(flat), 0.001)


def test_parse_claim_is_bounded_too():
    """``claims.parse_claim`` returns None instead of raising."""
    for data in BAD_CLAIMS.values():
        assert parse_claim(data) is None


def test_skipped_records_warn_once_per_kind_and_learner():
    skipped = SkippedRecords("learner 'me'")
    with pytest.warns(RecordSkippedWarning) as caught:
        for _ in range(5):
            assert skipped.read(ClaimRecord, b"{", "units/a") is None
            assert skipped.read(ClaimRecord, NESTED, "units/b") is None
            assert skipped.read(LeaseRecord, b"[]", "leases/x.json", "x") is None
            assert skipped.read(LeaseRecord, b"[]", "leases/y.json", "y") is None
    assert skipped.counts == {"claim": 10, "lease": 10} and skipped.total == 20
    messages = [str(warning.message) for warning in caught]
    assert len(messages) == 3, messages  # claims (no learner known), lease of x, lease of y
    assert "units/a" in messages[0] and "not JSON" in messages[0]
    assert "of learner 'x'" in messages[1] and "of learner 'y'" in messages[2]
    assert skipped.read(ClaimRecord, None, "units/c") is None  # missing is not unusable
    assert skipped.total == 20


# -- the elastic claimer's scans (orphans under lease=, own units under resume=) -----------------
@pytest.mark.parametrize("name", sorted(BAD_CLAIMS))
@pytest.mark.parametrize(
    "options",
    [ElasticOptions(resume=False, lease_s=30.0), ElasticOptions(resume=True, lease_s=None)],
    ids=["lease", "resume"],
)
def test_scans_skip_a_bad_claim_with_one_warning(memory_mailbox, name, options):
    """Before: InvalidKeyError ('..') and RecursionError (nested) in every lease=/resume= scan."""
    box = memory_mailbox
    box.put_if_absent(claim_key("u0"), BAD_CLAIMS[name])
    claimer = ElasticClaimer(box, ["u0", "u1", "u2"], "me", options)
    with pytest.warns(RecordSkippedWarning, match="units/u0") as caught:
        got = [claimer.claim_next() for _ in range(3)]
    assert [a.identifier if a else None for a in got] == ["u1", "u2", None]
    assert len(caught) == 1 and claimer.skipped.counts["claim"] >= 1
    assert box.get(claim_key("u0")) == BAD_CLAIMS[name], "a bad claim is left alone"


def test_a_bad_lease_or_work_record_does_not_stop_the_claimer(memory_mailbox):
    box = memory_mailbox
    box.put_if_absent(claim_key("u0"), _body(learner="dead", token="t0", incarnation="old", state="active", step=None))
    box.put(lease_key("dead"), NESTED)
    box.put(work_key("me", "u1"), DEEP_SMALL)  # a "record of an earlier incarnation"
    box.put_if_absent(claim_key("u1"), _body(learner="me", token="t1", incarnation="old", state="active"))
    clock = [0.0]
    claimer = ElasticClaimer(
        box,
        ["u0", "u1", "u2"],
        "me",
        ElasticOptions(resume=True, lease_s=1.0),
        clock=lambda: clock[0],
        stopping=lambda: clock.__setitem__(0, clock[0] + 0.3),
    )
    with pytest.warns(RecordSkippedWarning) as caught:
        got = [claimer.claim_next() for _ in range(4)]
    identifiers = [a.identifier if a else None for a in got]
    # u1 is this learner's own (the scan takes it back by its claim), u2 is fresh, u0 is taken
    # over once the unreadable lease stood still for a lease, like a lease that never changes.
    assert sorted(filter(None, identifiers)) == ["u0", "u1", "u2"] and identifiers[-1] is None
    kinds = sorted(str(w.message).split("skipped ")[1].split(" ")[0] for w in caught)
    assert kinds == ["lease", "work"], [str(w.message) for w in caught]
    assert LeaseWatch(1.0).expired("dead", NESTED) is False  # first sight starts the clock


def test_take_over_of_a_claim_replaced_by_garbage_is_refused_not_unsafe(memory_mailbox):
    """A read-back that shows garbage means someone else replaced it: not ours, no error."""
    box = memory_mailbox
    box.put_if_absent(claim_key("u"), _body(learner="dead", token="t", state="released"))

    class Overwrites:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def replace_if(self, key, data, version):
            assert self.inner.replace_if(key, data, version)
            self.inner.put(key, NESTED)  # someone else's write lands right after ours
            return True

    assert take_over(Overwrites(box), "u", "me", "inc") is None


def test_release_skips_an_unreadable_work_record(memory_mailbox):
    options = ElasticOptions(resume=True, lease_s=None)
    tracker = ProgressTracker(memory_mailbox, "me", options)
    memory_mailbox.put(work_key("me", "u"), NESTED)
    with pytest.warns(RecordSkippedWarning, match="work record 'work/me/u'"):
        assert tracker.release() == 0
    assert memory_mailbox.get(work_key("me", "u")) == NESTED


# -- a whole queue, over S3 through moto's HTTP server and on a directory -------------------------
def _load(value: int):
    for step in range(2):
        yield step, torch.tensor([value, step])


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "s3"])
@pytest.mark.parametrize("mode", [{"lease": timedelta(seconds=30)}, {"resume": True}], ids=["lease", "resume"])
def test_a_queue_with_planted_bad_claims_delivers_every_other_unit_once(mailbox_factory, backend, mode):
    box = mailbox_factory(backend)
    units = {f"u{i}": i for i in range(6)}
    box.put_if_absent(claim_key("u1"), BAD_CLAIMS["dot-dot learner"])
    box.put_if_absent(claim_key("u3"), BAD_CLAIMS["deeply nested"])
    box.put_if_absent(claim_key("u4"), BAD_CLAIMS["not json"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with shared_queue(units, mailbox=box, learner_id="node-0", load=_load, workers=0, **mode) as batches:
            got = [(int(batch[0]), step) for step, batch in batches]
    assert sorted(got) == [(i, s) for i in (0, 2, 5) for s in range(2)]
    skipped = [str(w.message) for w in caught if issubclass(w.category, RecordSkippedWarning)]
    assert len(skipped) == 1 and "units/u" in skipped[0], skipped


# -- records too large to read: refused at the read, then skipped like any unusable record -------
def test_a_record_too_large_to_read_is_refused_at_the_read(memory_mailbox):
    box = memory_mailbox
    box.put("units/huge", b" " * (MAX_RECORD_BYTES + 1))
    box.put("units/ok", _body(learner="x", token="t"))
    refusal = r"claim 'units/huge': 65,537 bytes, more than a record may hold \(65,536 bytes\)"
    with pytest.raises(RecordError, match=refusal):
        get_record(box, "units/huge", CLAIM)
    with pytest.raises(RecordError, match=refusal):
        get_record_versioned(box, "units/huge", CLAIM)
    assert get_record(box, "units/missing") is None and get_record_versioned(box, "units/missing") is None
    assert ClaimRecord.fetch(box, "units/huge") is None and ClaimRecord.fetch(box, "units/missing") is None
    assert ClaimRecord.fetch(box, "units/ok").token == "t"
    skipped = SkippedRecords("learner 'me'")
    with pytest.warns(RecordSkippedWarning, match="units/huge"):
        assert skipped.fetch(ClaimRecord, box, "units/huge") is None
    assert skipped.get(ClaimRecord, box, "units/huge") is None and skipped.counts == {"claim": 2}
    assert skipped.fetch(ClaimRecord, box, "units/missing") is None and skipped.total == 2


def _plant_sparse(root, key: str) -> None:
    path = root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as file:
        os.truncate(file.fileno(), 2**30)  # 1 GiB that costs no disk, but 1 GiB of memory to read


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="sparse files as on Linux")
def test_huge_stray_records_cost_a_node_no_memory(tmp_path):
    """1 GiB files where a node reads its presence record, a claim, its own work record and a
    peer's lease: each is refused unread and handled as an unusable record (the presence record
    overwritten, the others skipped with a warning), and the node delivers every other unit."""
    from gradientmail import LocalMailbox

    box = LocalMailbox(tmp_path)
    for key in (learner_key("node-0"), claim_key("u1"), work_key("node-0", "u2"), lease_key("dead")):
        _plant_sparse(tmp_path, key)
    box.put_if_absent(claim_key("u2"), _body(learner="node-0", token="t2", incarnation="old", state="active"))
    box.put_if_absent(claim_key("u3"), _body(learner="dead", token="t3", incarnation="old", state="active"))
    units = {f"u{i}": i for i in range(5)}
    tracemalloc.start()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with shared_queue(
                units, mailbox=box, learner_id="node-0", load=_load, workers=0, resume=True, lease=timedelta(seconds=1)
            ) as batches:
                got = sorted({int(batch[0]) for _, batch in batches})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, f"a node peaked at {peak / 2**20:.0f} MiB of Python memory"
    # u1's claim is unreadable: nobody can take it over. u2 is this learner's own, taken back by
    # its claim; u3 once its owner's unreadable lease stood still a lease, as a missing one would.
    assert got == [0, 2, 3, 4]
    messages = [str(w.message) for w in caught]
    assert any("presence record 'learners/node-0.json'" in m and "1,073,741,824 bytes" in m for m in messages)
    skipped = {m.split("skipped ")[1].split(" '")[0] for m in messages if "skipped " in m}
    assert {"claim", "work record", "lease"} <= skipped, messages
    assert box.get(learner_key("node-0"), max_bytes=MAX_RECORD_BYTES) is not None  # overwritten: a record now


def test_a_run_record_too_large_to_read_is_no_run_to_join(memory_mailbox):
    memory_mailbox.put("run.json", b" " * (MAX_RECORD_BYTES + 1))
    with pytest.raises(RunMismatchError, match="65,537 bytes, more than a record may hold"):
        prepare_mailbox(memory_mailbox, 2, ["a", "b"])
