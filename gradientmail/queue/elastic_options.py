"""The elastic queue's options: what ``resume=`` and ``lease=`` ask of a dataset, checked against its store.

``check_elastic`` validates the arguments and refuses a store without compare-and-swap for them;
``elastic_options`` turns them into the ``ElasticOptions`` a dataset carries into its workers
(None: the design note's queue). Details: docs/elastic.md.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import timedelta

from gradientmail.fold_gate import UnitMark
from gradientmail.mailbox.base import Mailbox, require_replace_if, supports_replace_if
from gradientmail.queue.liveness import lease_seconds

__all__ = ["check_elastic", "elastic_options", "ElasticOptions"]


@dataclass(frozen=True)
class ElasticOptions:
    """What a dataset carries into its workers when resume or leases are on.

    ``incarnation`` names one run of a learner (a fresh ``uuid4`` each time a queue is
    iterated), so that a restarted node tells its own earlier, dead self's units from the
    units its current workers hold.
    """

    resume: bool
    lease_s: float | None
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex)
    automatic: bool = False
    """Chosen by ``resume=None`` (the default), not asked for: a clean exit keeps this learner's
    unfinished units reserved for it (``releases``), and where consumption cannot be seen (a
    DataLoader worker) the dataset falls back to the design note's queue instead of refusing."""
    joined_marks: tuple[tuple[UnitMark, ...], ...] | None = None
    """This learner's unit marks per fragment as its Session read them when joining (its counts
    continue from that read), for taking its earlier incarnation's units back; None: read the
    store (``FoldGate.take_join_marks``)."""

    @property
    def releases(self) -> bool:
        """Whether a clean exit releases unfinished units to any node: asked for with
        ``resume=True`` or ``lease=``; the automatic mode keeps them for this learner id (the
        design note's reservations stay permanent, only their owner takes them back)."""
        return not self.automatic or self.lease_s is not None


def check_elastic(mailbox: Mailbox, resume: object, lease: timedelta | float | None) -> float | None:
    """Validate ``resume`` / ``lease`` and refuse a store without compare-and-swap for them.

    ``resume=None`` (automatic) needs nothing: without ``replace_if`` it is the design note's queue.
    """
    if resume is not None and not isinstance(resume, bool):
        raise TypeError(f"resume must be True, False or None (automatic), not {type(resume).__name__}")
    seconds = lease_seconds(lease)
    if resume or seconds is not None:
        feature = "resume=True" if resume else f"lease={lease!r}"
        require_replace_if(mailbox, feature)
    return seconds


def elastic_options(mailbox: Mailbox, resume: bool | None, lease_s: float | None) -> ElasticOptions | None:
    """The elastic options ``resume`` and ``lease_s`` ask for (None: the design note's queue).

    ``resume=None`` keeps the resume bookkeeping wherever the store has ``replace_if``, so a
    learner restarted under the same id takes its unfinished units back exactly.
    """
    if resume is None:
        if supports_replace_if(mailbox):
            return ElasticOptions(True, lease_s, automatic=True)
        resume = False
    if resume or lease_s is not None:
        return ElasticOptions(resume, lease_s)
    return None
