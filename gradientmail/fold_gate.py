"""``FoldGate``: a batch counts as done only once the progress trained on it is in the run.

The elastic queue records which batches a learner consumed, so that a unit whose learner died
is continued by another node after its last recorded batch. With a ``Session`` in the same
process, a consumed batch is not yet in the model: its progress reaches the run's state at the
learner's next fold of every fragment (up to ``every`` later). Recording it at once would lose
it for good if the learner died before that fold. The gate holds each consumption record until
every fragment has folded a snapshot taken after that batch was trained; a learner that dies
leaves records that end at the last batch whose progress is in the run, and whoever continues
its units trains the rest again. Nothing is held without a Session (the queue alone).

A record written after its fold leaves a window: a node frozen or killed after the fold landed
and before the record was written would have the batches trained again by whoever continues. So
each snapshot also carries the *unit marks* (``UnitMark``): for every unit whose latest batch
delivered is not yet in a written record, that batch's position, however many units that is.
The Session stores them in the learner's line of the run's state (past ``MAX_UNIT_MARKS``, in an
object the line names: ``gradientmail.session.marks_store``), and a takeover continues after the
further of the record and the marks every fragment holds (``gradientmail.session.folded_units``).

The Session and the queue of one learner find their gate at their ``MeetingPoint``
(``gradientmail.meeting_point``), so the documented loop needs no new argument.

Example:
    >>> gate = FoldGate()
    >>> released = []
    >>> gate.listen(released.append)
    >>> first, second = gate.deliver(), gate.deliver()
    >>> gate.holds(second)  # no Session attached: nothing is held
    False
    >>> link = gate.attach(lambda: None, fragments=2)
    >>> third = gate.deliver()
    >>> gate.holds(third), link.mark()
    (True, 3)
    >>> _ = gate.deliver(UnitMark("u", "t", 7, 0)); link.snapshot()
    (4, {'u': UnitMark(unit='u', token='t', step=7, position=0)})
    >>> link.landed(0, 3); gate.holds(third)
    True
    >>> link.landed(1, 3); gate.holds(third), released
    (False, [3])
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

__all__ = [
    "MAX_UNIT_MARKS",
    "FoldGate",
    "SessionLink",
    "UnitMark",
    "held_everywhere",
    "unit_marks_from_json",
]

MAX_UNIT_MARKS = 64
"""Unit marks a line of the run's state holds itself; a snapshot with more (small units, many
folded per exchange) puts them all in an object the line names (``session.marks_store``)."""


class UnitMark(NamedTuple):
    """The last batch of ``unit`` (claimed under ``token``) a snapshot holds: ``step`` label,
    ``position`` in the unit's ``load()`` iteration."""

    unit: str
    token: str
    step: int
    position: int | None


MAX_MARK_CHARS = 1024
"""Longest unit id or claim token a unit mark may hold (both are key segments or hex tokens)."""


def unit_marks_from_json(value: object, limit: int, most: int = MAX_UNIT_MARKS) -> tuple[UnitMark, ...]:
    """Unit marks read back from the store (untrusted): at most ``most``, strings short, steps
    and positions within ``limit``.

    Raises:
        ValueError: naming what is wrong.
    """
    if not isinstance(value, list) or len(value) > most:
        raise ValueError(f"units is not a list of at most {most} marks")
    marks = []
    for item in value:
        if not (isinstance(item, list) and len(item) == 4):
            raise ValueError("a unit mark is not [unit, token, step, position]")
        unit, token, step, position = item
        for name, text in (("unit", unit), ("token", token)):
            if not isinstance(text, str) or not 0 < len(text) <= MAX_MARK_CHARS:
                raise ValueError(f"a unit mark's {name} is not a short string")
        if isinstance(step, bool) or not isinstance(step, int) or not -limit <= step <= limit:
            raise ValueError(f"unit mark step {str(step)[:40]!r} is not a step label")
        if position is not None and (
            isinstance(position, bool) or not isinstance(position, int) or not 0 <= position <= limit
        ):
            raise ValueError(f"unit mark position {str(position)[:40]!r} is not a position")
        marks.append(UnitMark(unit, token, step, position))
    return tuple(marks)


def held_everywhere(marks: Sequence[Sequence[UnitMark]], unit: str, token: str) -> UnitMark | None:
    """The mark of ``unit`` under the claim ``token`` that every fragment's marks (``marks``:
    one sequence per fragment) hold: the one of fewest batches; None if some fragment has none."""
    everywhere: UnitMark | None = None
    for fragment in marks:
        mark = next((m for m in fragment if m.unit == unit and m.token == token), None)
        if mark is None or mark.position is None:
            return None
        if everywhere is None or mark.position < (everywhere.position or 0):
            everywhere = mark
    return everywhere


class FoldGate:
    """Counts the batches handed to the training loop and how many of them the run holds.

    Batch indices start at 1 in the order the loop received them. A Session attached folds
    snapshots, each marked with the index of the last batch delivered when it was taken; the
    gate's ``folded`` index is the smallest mark that every fragment has folded (or left
    pending, which is in the run too).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._delivered = 0
        self._link: SessionLink | None = None
        self._landed: list[int] = []  # per fragment of the attached Session, its newest mark folded
        self._folded = 0
        self._unwritten: dict[str, tuple[int, UnitMark]] = {}  # unit -> (index, its latest batch)
        self._listeners: list[Callable[[int | None], None]] = []
        self._owner_check: Callable[[], None] | None = None
        self._owner_confirm: Callable[[], None] | None = None
        self._join_marks: tuple[tuple[UnitMark, ...], ...] | None = None
        self.pause_limit_s = math.inf  # a Session that stood still this long asks _owner_check

    def deliver(self, mark: UnitMark | None = None) -> int:
        """Count one batch handed to the loop (``mark``: which unit and where); its index."""
        with self._lock:
            self._delivered += 1
            if mark is not None:
                self._unwritten.pop(mark.unit, None)  # re-inserted last: the dict keeps delivery order
                self._unwritten[mark.unit] = (self._delivered, mark)
            return self._delivered

    def written(self, unit: str, index: int) -> None:
        """The records of ``unit`` up to batch ``index`` are on the store: no mark needed for them."""
        with self._lock:
            entry = self._unwritten.get(unit)
            if entry is not None and entry[0] <= index:
                del self._unwritten[unit]

    def holds(self, index: int) -> bool:
        """Whether the record of batch ``index`` must wait: a Session is attached and has not
        folded it yet."""
        with self._lock:
            return self._link is not None and index > self._folded

    @property
    def folded(self) -> int:
        """The largest batch index the run holds (every batch, once no Session holds them)."""
        with self._lock:
            return self._folded if self._link is not None else self._delivered

    @property
    def attached(self) -> bool:
        with self._lock:
            return self._link is not None

    def listen(self, listener: Callable[[int | None], None]) -> None:
        """Call ``listener(folded)`` whenever the folded index advances (from the Session's
        thread); ``listener(None)`` when the Session left without folding what is held."""
        with self._lock:
            self._listeners.append(listener)

    def unlisten(self, listener: Callable[[int | None], None]) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def guard(
        self,
        check: Callable[[], None] | None,
        pause_limit_s: float = math.inf,
        confirm: Callable[[], None] | None = None,
    ) -> None:
        """The queue's ``check()`` raises when peers took this learner's units over; a Session
        that stood still ``pause_limit_s`` or more calls it before its next exchange, so that
        a process frozen past its lease folds nothing more (None: no check). ``confirm()`` does
        the same by beating the learner's lease, which no peer may take over until it stood
        still a whole lease again (``confirm_owner``)."""
        with self._lock:
            self._owner_check, self.pause_limit_s = check, pause_limit_s if check is not None else math.inf
            self._owner_confirm = confirm

    def check_owner(self) -> None:
        """Raise ``LeaseLostError`` if the queue finds this learner's units taken over."""
        with self._lock:
            check = self._owner_check
        if check is not None:
            check()

    def confirm_owner(self) -> None:
        """Right before a fold that holds batches whose records are not written: raise
        ``LeaseLostError`` if peers judged this learner dead and fenced its lease, else beat the
        lease (one read and one compare-and-swap, however many units the fold holds), so that no
        peer fences it and takes a unit over before the fold has landed (a peer waits for the
        lease to stand still a whole lease, and its fence fails once the beat landed:
        ``gradientmail.queue.lease``)."""
        with self._lock:
            confirm = self._owner_confirm or self._owner_check
        if confirm is not None:
            confirm()

    def attach(
        self,
        sync: Callable[[], None],
        fragments: int,
        revoke: Callable[[], None] = lambda: None,
        joined: Sequence[Sequence[UnitMark]] | None = None,
    ) -> SessionLink:
        """A Session joins: from now on records wait for its folds. ``sync()`` folds every
        fragment now and waits (the queue calls it while the training loop is not training);
        ``revoke()`` makes it fold nothing more and waits for a fold under way (``revoke``);
        ``joined``: this learner's unit marks per fragment in the state the Session joined from
        (``take_join_marks``)."""
        with self._lock:
            self._join_marks = None if joined is None else tuple(tuple(marks) for marks in joined)
            self._link = SessionLink(self, sync, revoke)
            self._landed = [self._delivered] * fragments
            self._folded = self._delivered
            return self._link

    def detach(self, link: SessionLink, *, release: bool) -> None:
        """The Session left; ``release``: its final fold holds every batch delivered so far."""
        with self._lock:
            if self._link is not link:
                return
            self._link = None
            self._join_marks = None
            folded, listeners = self._delivered, list(self._listeners)
            if release:
                self._folded = folded
        for listener in listeners:
            listener(folded if release else None)

    def take_join_marks(self) -> tuple[tuple[UnitMark, ...], ...] | None:
        """This learner's unit marks per fragment as the attached Session read them when it
        joined, for the first queue that asks (None after, or without a Session).

        A restarted learner's Session continues its counts from the lines it read when joining;
        the queue that takes the dead incarnation's units back must continue them from the marks
        of that same read. A fold the dead process had in flight may land later (a request sent
        before the kill, answered by the store after the restart read the state): with marks read
        then, its batches would be skipped but never counted. With these, they are trained again
        and counted once (the fragment that holds the late fold holds them twice, as after a death
        mid-round). Later queues under the same Session read the store: their claims' marks come
        from this Session's own folds, which its counts include.
        """
        with self._lock:
            marks, self._join_marks = self._join_marks, None
            return marks

    def revoke(self) -> bool:
        """The queue stops without recording every batch delivered (an error, a replaced or
        frozen process): the Session folds nothing more, so that no batch the queue leaves to be
        trained again reaches the run from here too. Returns once a fold under way has ended;
        True if a Session was attached (its last fold may have landed unbeknown to the gate)."""
        with self._lock:
            link = self._link
        if link is not None:
            link.revoke()
        return link is not None

    def folded_mark(self, unit: str) -> UnitMark | None:
        """The latest batch delivered of ``unit`` if the run holds it and its record is not
        written (where a release of the unit must say it stands), else None."""
        with self._lock:
            entry = self._unwritten.get(unit)
            return entry[1] if entry is not None and entry[0] <= self._folded else None

    def settle(self) -> None:
        """Fold everything delivered so far, when a Session is attached and has not (queue closing)."""
        with self._lock:
            link = self._link
            if link is None or self._folded >= self._delivered:
                return
        link.sync()

    def mark(self) -> int:
        """The index of the last batch delivered: a snapshot taken now holds its progress."""
        with self._lock:
            return self._delivered

    def snapshot(self) -> tuple[int, dict[str, UnitMark]]:
        """``mark()`` and the unit marks of the batches it holds whose records are not written
        (every one of them: a mark left out would let those batches be trained twice)."""
        with self._lock:
            return self._delivered, {mark.unit: mark for _, mark in self._unwritten.values()}

    def landed(self, link: SessionLink, fragment: int, mark: int) -> None:
        """``link``'s fragment ``fragment`` folded (or left pending) a snapshot taken at ``mark``."""
        with self._lock:
            if self._link is not link:
                return
            self._landed[fragment] = max(self._landed[fragment], mark)
            folded = min(self._landed)
            if folded <= self._folded:
                return
            self._folded = folded
            listeners = list(self._listeners)
        for listener in listeners:
            listener(folded)


class SessionLink:
    """A Session's handle on its gate: marks its snapshots, reports the folds that landed."""

    def __init__(self, gate: FoldGate, sync: Callable[[], None], revoke: Callable[[], None]) -> None:
        self.gate = gate
        self.sync = sync
        self.revoke = revoke

    def mark(self) -> int:
        return self.gate.mark()

    def snapshot(self) -> tuple[int, dict[str, UnitMark]]:
        return self.gate.snapshot()

    def landed(self, fragment: int, mark: int) -> None:
        self.gate.landed(self, fragment, mark)
