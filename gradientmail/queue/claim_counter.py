"""Units claimed per learner (and store), counted across this process and its DataLoader workers."""

from __future__ import annotations

import ctypes
import multiprocessing
import threading
from collections.abc import Hashable
from typing import Any

__all__ = [
    "ClaimCounter",
    "register_counter",
    "SLOTS",
    "units_claimed_by",
]


SLOTS = 256
"""Counter slots per dataset: 0 for this process, 1 + worker id for DataLoader workers."""

_COUNTERS: dict[str, list[tuple[Hashable, ClaimCounter]]] = {}
_COUNTERS_LOCK = threading.Lock()


class ClaimCounter:
    """Units claimed through one dataset, in shared memory that worker processes write to.

    Each worker writes only its own slot, so no lock crosses processes; a plain shared array
    works whatever start method the DataLoader uses.

    Example:
        >>> counter = ClaimCounter()
        >>> counter.add(None); counter.add(3)
        >>> counter.total()
        2
    """

    def __init__(self) -> None:
        self._slots = multiprocessing.RawArray(ctypes.c_int64, SLOTS)
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"_slots": self._slots}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._slots = state["_slots"]
        self._lock = threading.Lock()

    def add(self, worker: int | None) -> None:
        """Count one claim, by DataLoader ``worker`` (None: this process)."""
        if worker is not None:
            # A worker process is the only writer of its slot (ids beyond the slots share one:
            # counts may then be approximate).
            self._slots[1 + worker % (SLOTS - 1)] += 1
            return
        with self._lock:  # several iterators may run in threads of this process
            self._slots[0] += 1

    def total(self) -> int:
        """Claims counted in every slot."""
        return sum(self._slots)


def register_counter(learner_id: str, store: Hashable = None) -> ClaimCounter:
    """A new counter that ``units_claimed_by(learner_id)`` includes, and
    ``units_claimed_by(learner_id, store)`` too (``store``: where its queue claims, as
    ``meeting_point.store_identity`` tells it)."""
    counter = ClaimCounter()
    with _COUNTERS_LOCK:
        _COUNTERS.setdefault(learner_id, []).append((store, counter))
    return counter


def units_claimed_by(learner_id: str, store: Hashable = None) -> int:
    """Units that ``learner_id`` claimed through queues created in this process (on ``store``
    only, when given: a ``meeting_point.store_identity``).

    Counts claims made here and in the DataLoader workers of those queues; a ``Session``
    reports those on its own store as ``"units"`` in the learner's progress record.

    Example:
        >>> units_claimed_by("a-learner-this-process-never-ran")
        0
    """
    with _COUNTERS_LOCK:
        counters = [counter for where, counter in _COUNTERS.get(learner_id, ()) if store is None or where == store]
    return sum(counter.total() for counter in counters)
