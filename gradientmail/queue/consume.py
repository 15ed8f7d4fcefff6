"""The iterator the training loop sees: ends for good, times units, and (elastic) records progress.

Data flows one way: a pump (``handoff.ThreadBatches``, ``loader.LoaderBatches``) delivers
``(step, batch[, tag])`` items; ``ElasticBatches`` on top hands the tags to
``elastic.Consumption`` and the loop gets plain pairs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from gradientmail.queue.batch_checks import Batch
from gradientmail.queue.progress import BATCH, Consumption, ProgressTracker
from gradientmail.queue.unit_timing import BatchWatch

__all__ = ["Batches", "ElasticBatches", "watched"]


class Batches(Iterator[Batch]):
    """Base of the iterators ``shared_queue`` yields; ends for good after an error or ``close``.

    Subclasses implement ``_next`` (one item from the pump) and ``close``.
    """

    on_end: Callable[[], None] | None = None
    """Called once when the batches run out (not after an error or ``close``)."""

    watch: BatchWatch | None = None
    """Times the loop's batches per unit (``unit_timing``) and strips their unit tags."""

    guard: Callable[[], None] | None = None
    """Called before each batch; raises to stop the loop (``Presence.check``: this process was
    replaced by another incarnation of its learner)."""

    def __init__(self) -> None:
        self._finished = False

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> Batch:
        if self._finished:
            raise StopIteration
        if self.guard is not None:
            try:
                self.guard()
            except BaseException:
                self._finished = True
                raise
        watch = self.watch
        if watch is not None:
            watch.ended()  # the loop asks for a batch: it has trained the previous one
        try:
            item = self._next()
            return item if watch is None else watched(watch, item)
        except StopIteration:
            self._finished = True
            if self.on_end is not None:
                self.on_end()
            raise
        except BaseException:
            self._finished = True
            raise

    def _next(self) -> Batch:
        raise NotImplementedError

    def close(self) -> None:
        """Stop the pump and release what it holds; the iterator then ends."""
        raise NotImplementedError


def watched(watch: BatchWatch, item: Any) -> Any:
    """Tell ``watch`` which unit ``item`` belongs to; strip a plain tag (elastic tags stay)."""
    tag = item[2] if isinstance(item, (tuple, list)) and len(item) == 3 else None
    if isinstance(tag, str):
        watch.taken(tag)
        return (item[0], item[1])
    if isinstance(tag, (tuple, list)) and len(tag) >= 3:
        if tag[2] == BATCH:
            watch.taken(tag[0] if isinstance(tag[0], str) else None)
        return item
    watch.taken(None)
    return item


class ElasticBatches(Batches):
    """Strips the elastic tags and tells the ``ProgressTracker`` what the loop consumed.

    Args:
        inner: The pump's batches, tagged.
        tracker: Records progress and renews the lease; closed with these batches.
        stop_claiming: Called on ``close``, so a claimer waiting for orphans stops waiting.
    """

    def __init__(self, inner: Batches, tracker: ProgressTracker, stop_claiming: Callable[[], None]) -> None:
        super().__init__()
        self._inner = inner
        self._tracker = tracker
        self._consumption = Consumption(tracker)
        self._stop_claiming = stop_claiming
        self._closed = False

    @property
    def tracker(self) -> ProgressTracker:
        """What records this learner's progress (``flush()`` waits for its writes)."""
        return self._tracker

    def _next(self) -> Batch:
        return self._consumption.next_from(self._inner)

    def close(self, consumed_last: bool = False, *, replaced: bool = False) -> None:
        """Stop the pump, then record the last batch as consumed (or not) and close the tracker
        (``replaced``: another incarnation of this learner took over; write nothing more)."""
        if self._closed:
            return
        self._closed = True
        self._finished = True
        self._stop_claiming()
        try:
            self._inner.close()
        finally:
            self._consumption.finish(consumed_last=consumed_last)
            try:
                if consumed_last and not replaced:  # a clean exit: the Session folds what records wait for
                    self._tracker.settle()
            finally:
                self._tracker.close(replaced=replaced, clean=consumed_last and not replaced)
