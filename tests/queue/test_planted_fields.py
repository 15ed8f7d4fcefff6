"""Every field of every record is checked by its reader: a wrong-typed value never reaches a scan.

Anyone who can write the mailbox can plant a record whose fields hold anything: a list where a
token belongs, a dict, a string, an int past any count, NaN, null. For every record kind and
every field it declares (and for a field it does not declare), such a value planted into a run's
mailbox is either accepted by the field's check (then every typed property reads a value of its
type, or None) or makes the record unusable: skipped with a warning naming the key and field.
The status reader and the claimer's scans (under ``lease=`` and under ``resume=``) go on, and
every unit whose claim is usable is claimed exactly once. A field no kind declares is opaque:
kept for a rewrite, never handed to code, so no decision depends on an unchecked value.
"""

from __future__ import annotations

import json
import warnings
from datetime import timedelta

import pytest
import torch

from gradientmail import LocalMailbox, MemoryMailbox, RecordSkippedWarning
from gradientmail.layout import (
    RUN_KEY,
    claim_key,
    done_key,
    learner_key,
    lease_key,
    member_key,
    progress_key,
    work_key,
)
from gradientmail.patterns.shared_queue import shared_queue
from gradientmail.queue.elastic_options import ElasticOptions
from gradientmail.queue.reclaim import ElasticClaimer
from gradientmail.records import (
    CLAIM,
    ClaimRecord,
    DoneRecord,
    Field,
    LeaseRecord,
    MemberRecord,
    PresenceRecord,
    ProgressRecord,
    Record,
    RunRecord,
    SkippedRecords,
    UndeclaredFieldError,
    WorkRecord,
    parse,
)
from gradientmail.run_record import prepare_mailbox
from gradientmail.status import read_run

NOW = 1.7e9
NAN = object()
"""Stands for JSON's NaN, which ``json.dumps`` writes for ``float("nan")``."""
BAD_VALUES = {"list": [1], "dict": {"a": 1}, "str": "x", "huge": 10**40, "nan": NAN, "null": None, "bool": True}
UNITS = ["u0", "u1", "u2", "u3"]

# One usable record of each kind, at the key a run reads it from: u0 is claimed by a learner
# that died, u1 by this learner's earlier incarnation, u2 is done.
GOOD: dict[type[Record], tuple[str, dict]] = {
    ClaimRecord: (
        claim_key("u0"),
        dict(learner="dead", token="t0", host="h", pid=3, worker=None, claimed_at=NOW, incarnation="i0")
        | dict(state="active", step=1, taken_from="x", released_at=NOW, position=1),
    ),
    WorkRecord: (
        work_key("dead", "u0"),
        dict(learner="dead", token="t0", incarnation="i0", step=1, position=1, done=False, updated=NOW),
    ),
    DoneRecord: (done_key("u2"), dict(learner="dead", token="t2", at=NOW)),
    LeaseRecord: (
        lease_key("dead"),
        dict(learner="dead", incarnation="i0", beat=1, consumed=1, time=NOW, lease_s=1.0, state="running")
        | dict(fenced_by="x", fenced_at=NOW),
    ),
    PresenceRecord: (
        learner_key("dead"),
        dict(learner="dead", incarnation="i0", state="running", beat=1, time=NOW, renew_s=1.0, host="h")
        | dict(boot="b", pidns="p", pid=3, pid_start=5),
    ),
    ProgressRecord: (
        progress_key("dead"),
        dict(learner="dead", steps=1, samples=2, samples_in_run=2, samples_per_s=1.0, units=1, started=NOW)
        | dict(last_seen=NOW, finished=None)
        | {"unit_spans": {"recent": [{"unit": "u0", "first": NOW, "last": NOW, "batches": 1}], "older": {}}},
    ),
    RunRecord: (RUN_KEY, {}),  # the run's own, as ``prepare_mailbox`` wrote it
    MemberRecord: (member_key("dead", NOW), dict(learner="dead", joined=NOW)),
}


def _encode(fields: dict) -> bytes:
    text = json.dumps({name: "\0nan" if value is NAN else value for name, value in fields.items()})
    return text.replace('"\\u0000nan"', "NaN").encode()


def _run(mailbox) -> None:
    """A run of four units: u0 claimed by a dead learner, u1 by this learner's earlier incarnation."""
    prepare_mailbox(mailbox, len(UNITS), UNITS)
    for key, fields in GOOD.values():
        if fields:
            mailbox.put(key, _encode(fields))
    mailbox.put(claim_key("u1"), _encode(dict(learner="me", token="t1", incarnation="old", state="active")))


def _plants(record: type[Record]):
    for name in [*record.KIND.fields, "fold_beat"]:
        for label, value in BAD_VALUES.items():
            yield name, label, value


@pytest.fixture(params=["memory", "local"])
def fresh_box(request, tmp_path_factory):
    counter = iter(range(10**6))

    def make():
        if request.param == "memory":
            return MemoryMailbox(f"planted-{id(make)}-{next(counter)}")
        return LocalMailbox(tmp_path_factory.mktemp("planted"))

    return make


def _typed_reads(record: Record) -> None:
    """Every typed property of ``record`` reads its type or None, never raises."""
    for klass in type(record).__mro__:
        for name, value in vars(klass).items():
            if isinstance(value, Field):
                got = getattr(record, name)
                assert got is None or isinstance(got, value.kind) or value.kind is float, (name, got)
            elif isinstance(value, property):
                getattr(record, name)


@pytest.mark.parametrize("record", list(GOOD), ids=[r.__name__ for r in GOOD])
def test_a_planted_value_in_any_field_is_checked_or_the_record_skipped(fresh_box, record):
    for name, label, value in _plants(record):
        box = fresh_box()
        _run(box)
        key, fields = GOOD[record]
        if record is RunRecord:
            fields = json.loads(box.get(key))
        box.put(key, _encode({**fields, name: value}))
        skipped = SkippedRecords("test")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = skipped.fetch(record, box, key)
            status = read_run(box)
            claimed = {}
            for options in (ElasticOptions(resume=False, lease_s=1.0), ElasticOptions(resume=True, lease_s=None)):
                clock = [0.0]
                claimer = ElasticClaimer(
                    box,
                    UNITS,
                    "me",
                    options,
                    clock=lambda clock=clock: clock[0],
                    stopping=lambda clock=clock: clock.__setitem__(0, clock[0] + 0.6),
                )
                claimed[options.resume] = [a.identifier for a in iter(claimer.claim_next, None)]
        messages = [str(w.message) for w in caught if issubclass(w.category, RecordSkippedWarning)]
        where = f"{record.__name__}.{name} = {label}"
        if got is None:  # unusable: skipped with the key and the field named
            named = "NaN is not JSON" if value is NAN else repr(name)  # NaN: refused by the parser
            assert skipped.total == 1 and messages and key in messages[0] and named in messages[0], where
        else:
            _typed_reads(got)
            if name not in record.KIND.fields:
                with pytest.raises(UndeclaredFieldError):
                    got.get(name)
                assert name not in got.to_dict() and name in json.loads(got.to_bytes()), where
        for resume, units in claimed.items():
            assert len(units) == len(set(units)), (where, resume, units)  # nothing claimed twice
            assert {"u3"} <= set(units), (where, resume, units)  # the untouched unit is claimed
        assert {claim.identifier for claim in status.claims} >= {"u1"}, where


def test_an_undeclared_field_is_never_handed_to_code():
    """A claim with ``"fold_beat": [1]``: code that read it crashed every leased scan
    (``TypeError: unhashable type: 'list'``). Now only declared, checked fields can be read."""
    body = _encode(dict(learner="dead", token="t0", state="active", fold_beat=[1]))
    claim = ClaimRecord.from_bytes(body)
    with pytest.raises(UndeclaredFieldError, match="'fold_beat'"):
        claim.get("fold_beat")
    with pytest.raises(UndeclaredFieldError, match="'fold_beat'"):
        claim["fold_beat"]
    with pytest.raises(UndeclaredFieldError, match="'fold_beat'"):
        claim.replace(fold_beat=2)
    assert "fold_beat" not in claim and "fold_beat" not in claim.to_dict()
    assert "fold_beat" not in parse(CLAIM, body)
    assert claim.replace(state="released").to_bytes().startswith(b'{"learner":"dead","token":"t0","state":"released"')
    assert b'"fold_beat":[1]' in claim.replace(state="released").to_bytes()  # kept for a newer reader
    with pytest.raises(TypeError, match="does not declare"):

        class Reads(ClaimRecord):  # a typed read of an undeclared field fails at definition
            fold_beat = Field(list)


def _load(identifier: str):
    for step in range(2):
        yield step, torch.tensor([int(identifier[1:]), step])


def test_a_leased_run_with_a_planted_bad_claim_trains_every_unit_once(memory_mailbox):
    """A dead learner's claim with an undeclared list field (taken over once its lease expires)
    and a claim whose token is a list (unusable: skipped with a warning, nobody can take it)."""
    box = memory_mailbox
    units = {f"u{i}": f"u{i}" for i in range(5)}
    prepare_mailbox(box, len(units), list(units))
    box.put(claim_key("u0"), _encode(dict(learner="dead", token="t0", incarnation="i0", state="active", fold_beat=[1])))
    box.put(claim_key("u3"), _encode(dict(learner="dead", token=[1], incarnation="i0", state="active")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with shared_queue(
            units, mailbox=box, learner_id="me", load=_load, workers=0, lease=timedelta(seconds=1)
        ) as batches:
            got = sorted((int(batch[0]), step) for step, batch in batches)
    assert got == [(i, s) for i in (0, 1, 2, 4) for s in range(2)]  # u0 taken over, once
    skipped = [str(w.message) for w in caught if issubclass(w.category, RecordSkippedWarning)]
    assert len(skipped) == 1 and "units/u3" in skipped[0] and "'token'" in skipped[0], skipped
