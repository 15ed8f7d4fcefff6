"""``MeetingPoint``: where a learner's queue and its Session in one process find each other.

The documented loop, ``with session, shared_queue(mailbox, ...):``, passes nothing from one to
the other, yet they must cooperate: the queue records a batch as consumed only once the Session
has folded it into the run (``gate``, a ``FoldGate``), and the Session's progress record shows
what the queue claimed and when it trained each unit (``report_figures`` / ``queue_figures``).
They meet at the one ``MeetingPoint`` of their store and learner id in this process
(``meeting_point``). The store is told by its identity (``store_identity``: the URL that
``open_mailbox`` opens the same store from, or, for a mailbox without a URL, the object
itself; a wrapper from ``gradientmail.mailbox.wrappers`` is told by the store it wraps), never
by a description, so two mailbox objects over one store meet, and two stores that print alike
do not. Details: docs/development.md.

Example:
    >>> from gradientmail.mailbox.memory import MemoryMailbox
    >>> point = meeting_point(MemoryMailbox("meet-doc"), "node-0")
    >>> point is meeting_point(MemoryMailbox("meet-doc"), "node-0")  # another object, same store
    True
    >>> point is meeting_point(MemoryMailbox("meet-doc"), "node-1")
    False
    >>> point.queue_figures()  # no queue reported yet
    QueueFigures(units=None, unit_spans=None)
    >>> point.report_figures(lambda: QueueFigures(units=3))
    >>> point.queue_figures().units
    3
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from gradientmail.fold_gate import FoldGate
from gradientmail.mailbox.wrappers import MailboxWrapper

__all__ = ["MeetingPoint", "QueueFigures", "meeting_point", "store_identity"]


@dataclass(frozen=True)
class QueueFigures:
    """What a learner's queue reports to its Session's progress record."""

    units: int | None = None
    """Units this learner claimed in this process (DataLoader workers included)."""
    unit_spans: dict[str, Any] | None = None
    """When and for how long it trained its recent units (``queue.unit_timing.spans_record``)."""


class MeetingPoint:
    """One learner's queue and Session in this process, on one store: what they share.

    Attributes:
        store: The store's identity (``store_identity``).
        learner_id: The learner both run as.
        gate: Holds the queue's consumption records until the Session has folded them.
    """

    def __init__(self, store: Hashable, learner_id: str) -> None:
        self.store = store
        self.learner_id = learner_id
        self.gate = FoldGate()
        self._lock = threading.Lock()
        self._figures: Callable[[], QueueFigures] | None = None

    def __repr__(self) -> str:
        return f"MeetingPoint({self.store!r}, {self.learner_id!r})"

    def report_figures(self, figures: Callable[[], QueueFigures] | None) -> None:
        """The queue hands the Session what its progress record shows (units claimed, recent
        units' spans): ``figures()`` is asked at each progress write; None: nothing."""
        with self._lock:
            self._figures = figures

    def queue_figures(self) -> QueueFigures:
        """What the learner's queue reports (empty without a queue, or when it fails: a status
        field must never fail an exchange)."""
        with self._lock:
            figures = self._figures
        if figures is None:
            return QueueFigures()
        try:
            return figures()
        except Exception:
            return QueueFigures()


def store_identity(mailbox: object) -> Hashable:
    """Which store ``mailbox`` reaches, equal for every mailbox object over that store: its URL
    (what ``open_mailbox`` opens the same store from), or, when it has none, the object itself
    (for a ``MailboxWrapper``, the store it wraps)."""
    url = getattr(mailbox, "url", None)
    if isinstance(url, str) and url:
        return ("url", url)
    if isinstance(mailbox, MailboxWrapper):
        return store_identity(mailbox.inner)
    return ("object", mailbox)


_POINTS: dict[tuple[Hashable, str], MeetingPoint] = {}
_POINTS_LOCK = threading.Lock()


def meeting_point(mailbox: object, learner_id: str) -> MeetingPoint:
    """The meeting point of ``learner_id`` on ``mailbox``'s store in this process (made on first
    use; it lives as long as the process, as the learner's queues and Sessions may come and go)."""
    key = (store_identity(mailbox), learner_id)
    with _POINTS_LOCK:
        point = _POINTS.get(key)
        if point is None:
            point = _POINTS[key] = MeetingPoint(key[0], learner_id)
        return point
