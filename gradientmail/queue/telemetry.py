"""Run telemetry: units claimed per learner, when each unit was trained, and ``progress=True``.

Section ``counter`` below: Units claimed per learner, counted across this process and its DataLoader workers.

Section ``unit_timing`` below: When the training loop trained each unit: its first batch's start to its last batch's end.

Claims lead training by the prefetch buffer, so a Gantt chart needs the loop's own timing:
``BatchWatch`` notes when the loop takes a batch and asks for the next; the recent spans travel
in the ``Session``'s progress record (``spans_record``), the last ``KEEP_UNITS`` one by one and
older ones summed, for ``gradientmail plot``. Details: docs/queue.md.

Section ``progress_display`` below: ``shared_queue(..., progress=True)``: the run's units taken and this node's batches/s.

A display must not slow or break the training it shows, so it runs on a thread of its own and
reads only what is already at hand: this node's claim and batch counters (memory reads) and,
for the run-wide count, one listing of ``units/`` at most every ``LIST_EVERY_S`` seconds (longer
when listings are slow), never a request per batch. On a terminal it is a rich progress bar
(rich is the ``cli`` extra, imported only here); elsewhere (CI logs, files, pipes) one plain
line every ``PLAIN_EVERY_S`` seconds on stderr. Every error inside it is logged and swallowed;
``close`` stops and joins its thread, so leaving the ``with`` block leaves none behind.
"""

from __future__ import annotations

import ctypes
import json
import logging
import multiprocessing
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from gradientmail.errors import MissingExtraError
from gradientmail.fold_gate import QueueFigures

__all__ = [
    "BatchWatch",
    "ClaimCounter",
    "KEEP_UNITS",
    "LIST_EVERY_S",
    "PLAIN_EVERY_S",
    "ProgressDisplay",
    "SLOTS",
    "UnitTimes",
    "register_counter",
    "spans_record",
    "unit_times",
    "units_claimed_by",
]


# -- counter -----------------------------------------------------------------------------------------

SLOTS = 256
"""Counter slots per dataset: 0 for this process, 1 + worker id for DataLoader workers."""

_COUNTERS: dict[str, list[ClaimCounter]] = {}
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


def register_counter(learner_id: str) -> ClaimCounter:
    """A new counter that ``units_claimed_by(learner_id)`` includes."""
    counter = ClaimCounter()
    with _COUNTERS_LOCK:
        _COUNTERS.setdefault(learner_id, []).append(counter)
    return counter


def units_claimed_by(learner_id: str) -> int:
    """Units that ``learner_id`` claimed through queues created in this process.

    Counts claims made here and in the DataLoader workers of those queues; a ``Session``
    reports it as ``"units"`` in the learner's progress record.

    Example:
        >>> units_claimed_by("a-learner-this-process-never-ran")
        0
    """
    with _COUNTERS_LOCK:
        counters = list(_COUNTERS.get(learner_id, ()))
    return sum(counter.total() for counter in counters)


# -- unit_timing -------------------------------------------------------------------------------------

KEEP_UNITS = 64
"""Units whose span a progress record carries one by one (the most recent ones)."""

MAX_SPANS_BYTES = 16 * 1024
"""Most bytes the spans may take in a progress record (records are bounded to 64 KiB)."""


@dataclass
class _Span:
    first: float
    last: float
    batches: int


class UnitTimes:
    """One learner's unit spans in this process; thread-safe (the loop adds, a Session reads)."""

    def __init__(self, keep: int = KEEP_UNITS) -> None:
        self.keep = keep
        self._recent: OrderedDict[str, _Span] = OrderedDict()  # by first batch
        self._older = {"units": 0, "batches": 0, "busy_s": 0.0}
        self._lock = threading.Lock()

    def add(self, identifier: str, start: float, end: float) -> None:
        """One batch of ``identifier`` was trained from ``start`` to ``end`` (unix seconds)."""
        with self._lock:
            span = self._recent.get(identifier)
            if span is None:
                self._recent[identifier] = _Span(start, end, 1)
                while len(self._recent) > self.keep:
                    self._retire(self._recent.popitem(last=False)[1])
                return
            span.first = min(span.first, start)
            span.last = max(span.last, end)
            span.batches += 1

    def _retire(self, span: _Span) -> None:
        self._older["units"] += 1
        self._older["batches"] += span.batches
        self._older["busy_s"] += max(0.0, span.last - span.first)

    @property
    def units(self) -> int:
        """Units with at least one batch trained."""
        with self._lock:
            return len(self._recent) + int(self._older["units"])

    def record(self) -> dict[str, Any] | None:
        """The ``unit_spans`` field of a progress record; None before any batch.

        ``{"recent": [{"unit", "first", "last", "batches"}, ...], "older": {"units",
        "batches", "busy_s"}}``, ``recent`` oldest first, at most ``MAX_SPANS_BYTES`` of JSON
        (units beyond that are counted in ``older``).
        """
        with self._lock:
            recent = list(self._recent.items())
            older = dict(self._older)
        if not recent and not older["units"]:
            return None
        kept: list[dict[str, Any]] = []
        size = 0
        for identifier, span in reversed(recent):
            entry = {"unit": identifier, "first": span.first, "last": span.last, "batches": span.batches}
            size += len(json.dumps(entry)) + 2
            if size > MAX_SPANS_BYTES:
                older["units"] += 1
                older["batches"] += span.batches
                older["busy_s"] += max(0.0, span.last - span.first)
                continue
            kept.append(entry)
        kept.reverse()
        return {"recent": kept, "older": older}


_TIMES: dict[tuple[str, str], UnitTimes] = {}
_TIMES_LOCK = threading.Lock()


def unit_times(store: str, learner_id: str) -> UnitTimes:
    """The spans of ``learner_id`` in the mailbox ``store`` (``describe(mailbox)``) timed in this
    process: created on first use, shared by its queues; another run (mailbox) starts afresh."""
    with _TIMES_LOCK:
        times = _TIMES.get((store, learner_id))
        if times is None:
            times = _TIMES[(store, learner_id)] = UnitTimes()
        return times


def spans_record(store: str, learner_id: str) -> dict[str, Any] | None:
    """The ``unit_spans`` field for ``learner_id``'s progress record in ``store``; None when
    this process timed nothing there."""
    with _TIMES_LOCK:
        times = _TIMES.get((store, learner_id))
    return None if times is None else times.record()


class BatchWatch:
    """Times the batches one training loop takes; counts them for the progress display.

    ``taken(identifier)`` when the loop receives a batch, ``ended()`` when it asks for the
    next one or leaves the block. Both are a clock read and a dict update: they run on the
    training thread and never raise.
    """

    def __init__(self, times: UnitTimes, clock: Callable[[], float] = time.time) -> None:
        self.times = times
        self.clock = clock
        self.batches = 0
        self._units: set[str] = set()
        self._open: tuple[str, float] | None = None

    @property
    def units(self) -> int:
        """Distinct units this loop took batches of."""
        return len(self._units)

    def taken(self, identifier: str | None) -> None:
        self.batches += 1
        if identifier is not None:
            self._units.add(identifier)
            self._open = (identifier, self.clock())

    def ended(self) -> None:
        open_, self._open = self._open, None
        if open_ is not None:
            try:
                self.times.add(open_[0], open_[1], self.clock())
            except Exception:  # a display aid must never break the training loop
                pass


# -- progress_display --------------------------------------------------------------------------------

log = logging.getLogger("gradientmail.queue")

PLAIN_EVERY_S = 10.0
"""Seconds between plain lines when stderr is not a terminal."""

REFRESH_S = 0.5
"""Seconds between refreshes of the terminal bar."""

LIST_EVERY_S = 5.0
"""Least seconds between listings of ``units/`` for the run-wide count (at least 20 times the
last listing's duration, so a listing of a huge run never keeps the store busy)."""

RATE_WINDOW_S = 10.0
"""batches/s is measured over about this many recent seconds."""


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except Exception:
        return False


class ProgressDisplay:
    """Shows a queue's progress until ``close``; see the module docstring.

    Args:
        learner_id: this node's name, shown on every line.
        total: the run's units.
        mine: units this node claimed so far (its claim counter).
        batches: batches this node's loop took so far.
        run_taken: units claimed by the whole run (a listing); None: show this node's only.
        stream: where to write (default: ``sys.stderr`` when ``start`` runs).
    """

    def __init__(
        self,
        *,
        learner_id: str,
        total: int,
        mine: Callable[[], int],
        batches: Callable[[], int],
        run_taken: Callable[[], int] | None = None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.learner_id = learner_id
        self.total = total
        self._mine = mine
        self._batches = batches
        self._run_taken = run_taken
        self._stream = stream
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._progress: Any = None  # rich.progress.Progress on a terminal
        self._task: Any = None
        self._started = 0.0
        self._listed: int | None = None
        self._next_listing = 0.0
        self._rates: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()  # one update at a time (thread, then close)
        self.lines = 0

    @property
    def terminal(self) -> bool:
        return self._progress is not None

    def start(self) -> None:
        """Start showing; ``MissingExtraError`` on a terminal without rich (nothing started)."""
        stream = self._stream if self._stream is not None else sys.stderr
        self._stream = stream
        if _is_terminal(stream):
            self._progress = self._rich_progress(stream)
        self._started = self._clock()
        self._rates.append((self._started, 0))
        if self._progress is not None:
            self._progress.start()
        self._thread = threading.Thread(target=self._run, name=f"gradientmail-display-{self.learner_id}", daemon=True)
        self._thread.start()

    def _rich_progress(self, stream: TextIO) -> Any:
        try:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
        except ImportError as exc:
            raise MissingExtraError(
                f"shared_queue(progress=True) on a terminal needs rich: pip install 'gradientmail[cli]' ({exc})"
            ) from exc
        progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[taken]}"),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            console=Console(file=stream),
            auto_refresh=False,  # refreshed by this display's own thread: no rich thread
        )
        self._task = progress.add_task(f"{self.learner_id} units", total=self.total, taken="", rate="")
        return progress

    def close(self) -> None:
        """Stop the thread, show the final state, release the terminal. Never raises."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            self._update(final=True)
        except Exception:
            log.debug("progress display: final update failed", exc_info=True)
        if self._progress is not None:
            try:
                self._progress.stop()
            except Exception:
                log.debug("progress display: stopping rich failed", exc_info=True)

    def _run(self) -> None:
        every = REFRESH_S if self._progress is not None else PLAIN_EVERY_S
        self._safe_list()  # the run-wide count before the first line
        while not self._stop.wait(every):
            self._safe_list()
            try:
                self._update(final=False)
            except Exception:
                log.debug("progress display: update failed", exc_info=True)

    def _safe_list(self) -> None:
        if self._run_taken is None or self._clock() < self._next_listing:
            return
        began = self._clock()
        try:
            self._listed = int(self._run_taken())
        except Exception as exc:  # the store may be out; the queue itself reports that
            log.debug("progress display: listing units failed: %r", exc)
        took = self._clock() - began
        self._next_listing = self._clock() + max(LIST_EVERY_S, 20 * took)

    def _rate(self, now: float, batches: int) -> float:
        self._rates.append((now, batches))
        while len(self._rates) > 2 and now - self._rates[1][0] >= RATE_WINDOW_S:
            self._rates.popleft()
        then, before = self._rates[0]
        return (batches - before) / (now - then) if now > then else 0.0

    def _update(self, *, final: bool) -> None:
        with self._lock:
            now = self._clock()
            mine, batches = int(self._mine()), int(self._batches())
            taken = max(mine, self._listed or 0)
            elapsed = now - self._started
            if final:
                rate = batches / elapsed if elapsed > 0 else 0.0
            else:
                rate = self._rate(now, batches)
            shown = "?" if self._listed is None else str(taken)
            if self._progress is not None:
                self._progress.update(
                    self._task,
                    completed=taken,
                    taken=f"{shown}/{self.total} units taken ({mine} by this node)",
                    rate=f"{batches:,} batches, {rate:.1f} batches/s",
                )
                self._progress.refresh()
                return
            what = "finished" if final else "training"
            line = (
                f"gradientmail: {self.learner_id} {what} [{elapsed:.0f}s]: units {shown}/{self.total} "
                f"taken ({mine} by this node), {batches:,} batches, {rate:.1f} batches/s"
                + (" on average" if final else "")
            )
            print(line, file=self._stream, flush=True)
            self.lines += 1


def queue_figures(store: str, learner_id: str) -> Callable[[], QueueFigures]:
    """What this process's queue of ``learner_id`` on ``store`` reports to its Session
    (``FoldGate.report_figures``): units claimed here, workers included, and recent units' spans."""
    return lambda: QueueFigures(units=units_claimed_by(learner_id), unit_spans=spans_record(store, learner_id))
