"""Unit marks too many for a line of the run's state travel in an object named by that line.

Each fold's line carries the learner's *unit marks* (``gradientmail.fold_gate``): for every unit
whose latest batch has no written consumption record yet, where that batch stands. With small
units a fold can hold hundreds or thousands of them, and every node reads every line of a
fragment's header at every fold, so past ``MAX_UNIT_MARKS`` the marks of one snapshot go to one
object, ``session/marks/{learner}/{token}.json``, written *before* any fold of that snapshot,
and the line names it (``MarksRef``: token, count, CRC-32). Only a takeover or a restart reads it.
A learner keeps its latest ``KEEP_OBJECTS`` marks objects (a line never names an older one for
long: its records are written seconds after its fold) and deletes them once every record is
written (a clean exit).
"""

from __future__ import annotations

import json
import logging
import uuid
import zlib
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from gradientmail.fold_gate import MAX_MARK_CHARS, MAX_UNIT_MARKS, UnitMark, unit_marks_from_json
from gradientmail.layout import marks_key, marks_prefix
from gradientmail.mailbox.base import Mailbox

__all__ = ["KEEP_OBJECTS", "MAX_MARKS", "MarksRef", "MarksWriter", "lines_marks", "read_marks", "resolve_marks"]

MAX_MARKS = 1_000_000
"""Most unit marks one object may hold: a million one-batch units folded in one exchange."""

MAX_MARK_BYTES = 2 * MAX_MARK_CHARS + 64
"""Most bytes one mark takes in the object (unit id, token, step, position, punctuation)."""

KEEP_OBJECTS = 8
"""Marks objects a learner keeps; older ones are deleted as new ones are written."""

_log = logging.getLogger("gradientmail.session")


class MarksRef(NamedTuple):
    """What a line says of its marks object: its token (in the key), how many marks, their CRC-32."""

    token: str
    count: int
    crc: int

    def to_json(self) -> list:
        return [self.token, self.count, self.crc]

    @classmethod
    def from_json(cls, value: object) -> MarksRef:
        """Read back from a header (untrusted).

        Raises:
            ValueError: naming what is wrong.
        """
        if not (isinstance(value, list) and len(value) == 3):
            raise ValueError("a marks reference is not [token, count, crc]")
        token, count, crc = value
        if not (isinstance(token, str) and 0 < len(token) <= 64 and token.isascii() and token.isalnum()):
            raise ValueError("a marks reference's token is not a short alphanumeric string")
        for name, number, top in (("count", count, MAX_MARKS), ("crc", crc, 2**32 - 1)):
            if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number <= top:
                raise ValueError(f"a marks reference's {name} {str(number)[:40]!r} is out of range")
        return cls(token, count, crc)


def _encode(marks: Sequence[UnitMark]) -> bytes:
    return json.dumps([list(mark) for mark in marks], separators=(",", ":")).encode()


class MarksWriter:
    """Writes one learner's marks objects and deletes those it no longer needs."""

    def __init__(self, mailbox: Mailbox, learner_id: str) -> None:
        self.mailbox = mailbox
        self.learner_id = learner_id
        self._written: deque[str] = deque()

    def inline_or_write(self, marks: Sequence[UnitMark]) -> tuple[tuple[UnitMark, ...], MarksRef | None]:
        """``(marks, None)`` when they fit in a line, else ``((), ref)`` after writing their object."""
        if len(marks) <= MAX_UNIT_MARKS:
            return tuple(marks), None
        return (), self.write(marks)

    def write(self, marks: Sequence[UnitMark]) -> MarksRef:
        """Write ``marks`` to a new object (one PUT) and return the reference a line carries."""
        if len(marks) > MAX_MARKS:
            raise ValueError(f"{len(marks)} unit marks in one snapshot, more than the {MAX_MARKS} an object holds")
        body = _encode(marks)
        ref = MarksRef(uuid.uuid4().hex, len(marks), zlib.crc32(body))
        key = marks_key(self.learner_id, ref.token)
        self.mailbox.put(key, body)
        self._written.append(key)
        while len(self._written) > KEEP_OBJECTS:
            self._delete(self._written.popleft())
        return ref

    def clear(self, *, earlier: bool = False) -> None:
        """Delete this learner's marks objects, an earlier incarnation's included, once they are
        all obsolete (every record written, the earlier units taken back: a clean exit).

        Args:
            earlier: The learner's lines named a marks object when this incarnation joined: list
                the learner's objects even if this incarnation wrote none.
        """
        if not self._written and not earlier:
            return  # none was ever written or named: no listing
        self._written.clear()
        for key in list(self.mailbox.list(marks_prefix(self.learner_id))):
            self._delete(key)

    def _delete(self, key: str) -> None:
        try:
            self.mailbox.delete(key)
        except Exception as exc:  # a leftover costs a few bytes; it must not fail a fold
            _log.debug("%s: deleting %r failed: %r", self.learner_id, key, exc)


def read_marks(mailbox: Mailbox, learner_id: str, ref: MarksRef) -> tuple[UnitMark, ...]:
    """The marks a line's ``ref`` names, read back (untrusted: size, CRC and every field checked).

    Raises:
        ValueError: the object is missing, too large, or does not hold what the line says.
    """
    key = marks_key(learner_id, ref.token)
    body = mailbox.get(key, max_bytes=2 + ref.count * MAX_MARK_BYTES)  # longer: ValueTooLargeError
    if body is None:
        raise ValueError(f"{key!r}, named by {learner_id!r}'s line of the run's state, does not exist")
    if zlib.crc32(body) != ref.crc:
        raise ValueError(f"{key!r} does not hold what the line names (CRC-32 differs)")
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{key!r} is not JSON: {exc}") from None
    marks = unit_marks_from_json(value, 2**62, most=ref.count)
    if len(marks) != ref.count:
        raise ValueError(f"{key!r} holds {len(marks)} unit marks, its line says {ref.count}")
    return marks


def resolve_marks(
    mailbox: Mailbox, learner_id: str, inline: tuple[UnitMark, ...], ref: MarksRef | None
) -> tuple[UnitMark, ...]:
    """A line's unit marks: ``inline``, or those of the object ``ref`` names.

    An object that cannot be read is reported (a warning) and counts as no marks: whoever
    continues those units goes by their consumption records, and may train again batches that
    the run's state already holds.
    """
    if ref is None:
        return inline
    try:
        return read_marks(mailbox, learner_id, ref)
    except ValueError as exc:
        _log.warning(
            "unit marks of learner %r unreadable (%s): its units continue from their records, "
            "which may train again batches the run already holds",
            learner_id,
            exc,
        )
        return ()


class _Line(Protocol):
    units: tuple[UnitMark, ...]
    marks: MarksRef | None


def lines_marks(mailbox: Mailbox, learner_id: str, lines: Sequence[_Line | None]) -> list[tuple[UnitMark, ...]]:
    """The unit marks of each of a learner's lines (one per fragment; None: no line), each
    marks object read once (the fragments' lines of one snapshot name the same one)."""
    objects: dict[MarksRef, tuple[UnitMark, ...]] = {}
    marks = []
    for line in lines:
        if line is None:
            marks.append(())
        elif line.marks is None:
            marks.append(line.units)
        else:
            if line.marks not in objects:
                objects[line.marks] = resolve_marks(mailbox, learner_id, line.units, line.marks)
            marks.append(objects[line.marks])
    return marks
