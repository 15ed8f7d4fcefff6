"""``shared_queue(..., progress=True)``: the run's units taken and this node's batches/s.

A display must not slow or break the training it shows, so it runs on a thread of its own and
reads only what is already at hand: this node's claim and batch counters (memory reads) and,
for the run-wide count, one listing of ``units/`` at most every ``LIST_EVERY_S`` seconds (longer
when listings are slow), never a request per batch. On a terminal it is a rich progress bar
(rich is the ``cli`` extra, imported only here); elsewhere (CI logs, files, pipes) one plain
line every ``PLAIN_EVERY_S`` seconds on stderr. Every error inside it is logged and swallowed;
``close`` stops and joins its thread, so leaving the ``with`` block leaves none behind.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TextIO

from gradientmail.errors import MissingExtraError

__all__ = [
    "LIST_EVERY_S",
    "PLAIN_EVERY_S",
    "ProgressDisplay",
]


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
