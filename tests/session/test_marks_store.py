"""Unit marks of a snapshot with many units travel in one object its lines name, read back as
untrusted input (size, CRC, every field), each object once, and only the latest few are kept."""

from __future__ import annotations

import json
import logging

import pytest

from gradientmail.errors import UnusableStateError
from gradientmail.fold_gate import MAX_UNIT_MARKS, FoldGate, UnitMark
from gradientmail.layout import MARKS_PREFIX, marks_key
from gradientmail.mailbox.wrappers import CountingMailbox
from gradientmail.session.mail import Contribution
from gradientmail.session.marks_store import (
    KEEP_OBJECTS,
    MarksRef,
    MarksWriter,
    lines_marks,
    read_marks,
    resolve_marks,
)


def marks(count: int) -> tuple[UnitMark, ...]:
    return tuple(UnitMark(f"u{n:05d}", f"t{n}", n, 0) for n in range(count))


def test_the_gate_s_snapshot_holds_every_unwritten_unit():
    gate = FoldGate()
    gate.attach(lambda: None, fragments=1)
    for mark in marks(3 * MAX_UNIT_MARKS):
        gate.deliver(mark)
    assert len(gate.snapshot()[1]) == 3 * MAX_UNIT_MARKS


def test_few_marks_stay_in_the_line_many_go_to_one_object(memory_mailbox):
    writer = MarksWriter(memory_mailbox, "n0")
    assert writer.inline_or_write(marks(MAX_UNIT_MARKS)) == (marks(MAX_UNIT_MARKS), None)
    assert not list(memory_mailbox.list(MARKS_PREFIX))
    inline, ref = writer.inline_or_write(marks(1000))
    assert inline == () and ref is not None and ref.count == 1000
    assert read_marks(memory_mailbox, "n0", ref) == marks(1000)
    line = Contribution(1, 1, 1, 1.0, units=inline, marks=ref)
    assert Contribution.from_json(json.loads(json.dumps(line.to_json())), where="w") == line


def test_a_writer_keeps_its_latest_objects_and_clears_them_all(memory_mailbox):
    writer = MarksWriter(memory_mailbox, "n0")
    refs = [writer.write(marks(70)) for _ in range(KEEP_OBJECTS + 3)]
    kept = sorted(memory_mailbox.list(MARKS_PREFIX))
    assert kept == sorted(marks_key("n0", ref.token) for ref in refs[-KEEP_OBJECTS:])
    memory_mailbox.put(marks_key("n0", "earlier"), b"[]")  # an earlier incarnation's
    memory_mailbox.put(marks_key("n1", "other"), b"[]")  # another learner's
    writer.clear()
    assert list(memory_mailbox.list(MARKS_PREFIX)) == [marks_key("n1", "other")]


def test_a_writer_that_wrote_nothing_clears_an_earlier_incarnation_s_objects_when_told(memory_mailbox):
    memory_mailbox.put(marks_key("n0", "earlier"), b"[]")  # named by the lines this incarnation joined
    writer = MarksWriter(memory_mailbox, "n0")
    writer.clear()  # nothing written, nothing named: no listing, nothing deleted
    assert list(memory_mailbox.list(MARKS_PREFIX)) == [marks_key("n0", "earlier")]
    writer.clear(earlier=True)
    assert list(memory_mailbox.list(MARKS_PREFIX)) == []


def test_each_object_is_read_once_for_all_the_lines_that_name_it(memory_mailbox):
    ref = MarksWriter(memory_mailbox, "n0").write(marks(100))
    counting = CountingMailbox(memory_mailbox)
    line = Contribution(1, 1, 1, 1.0, marks=ref)
    small = Contribution(1, 1, 1, 1.0, units=marks(2))
    assert lines_marks(counting, "n0", [line, None, small, line]) == [marks(100), (), marks(2), marks(100)]
    assert counting.counts["get"] == 1


@pytest.mark.parametrize(
    ("tamper", "match"),
    [
        (lambda body, key, box: box.delete(key), "does not exist"),
        (lambda body, key, box: box.put(key, body[:-1] + b",1]"), "CRC"),
        (lambda body, key, box: box.put(key, body + b" " * 10**6), "more than"),
    ],
    ids=["missing", "changed", "too-large"],
)
def test_a_marks_object_that_does_not_hold_what_its_line_says_is_refused(memory_mailbox, tamper, match, caplog):
    ref = MarksWriter(memory_mailbox, "n0").write(marks(100))
    key = marks_key("n0", ref.token)
    tamper(memory_mailbox.get(key), key, memory_mailbox)
    with pytest.raises(ValueError, match=match):
        read_marks(memory_mailbox, "n0", ref)
    with caplog.at_level(logging.WARNING, logger="gradientmail.session"):
        assert resolve_marks(memory_mailbox, "n0", (), ref) == ()  # counted as no marks...
    assert "unit marks of learner 'n0' unreadable" in caplog.text  # ...and said


def test_a_line_s_marks_reference_is_checked_like_every_header_field():
    good = MarksRef("ab12", 100, 7)
    assert MarksRef.from_json(good.to_json()) == good
    for bad in [["ab12", 100], ["../x", 1, 1], ["ab12", -1, 1], ["ab12", True, 1], ["ab12", 1, 2**32], [1, 1, 1]]:
        with pytest.raises(UnusableStateError, match="marks reference"):
            Contribution.from_json([1, 1, 1, 1.0, False, [], bad], where="state 'x'")
