"""The iterator the training loop sees: ends for good, times units, and (elastic) records progress.

Data flows one way: a pump (``handoff.ThreadBatches``, ``loader.LoaderBatches``) delivers
``batch_checks.Item``s (a batch and its unit's ``UnitTag``); ``Batches`` times them per unit, and
``ElasticBatches`` on top hands the tags to ``progress.Consumption``: the loop gets plain pairs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from gradientmail.queue.batch_checks import Batch, Item
from gradientmail.queue.pacing import BufferGauge
from gradientmail.queue.progress import Consumption, ProgressTracker
from gradientmail.queue.unit_timing import BatchWatch

__all__ = [
    "Batches",
    "ElasticBatches",
    "LoopHooks",
    "watched",
]


@dataclasses.dataclass(frozen=True)
class LoopHooks:
    """What the iterator the loop holds calls around each batch, given whole at construction.

    Attributes:
        watch: Times the loop's batches per unit (``unit_timing``) and strips their unit tags.
        guard: Called before each batch; raises to stop the loop (``Presence.check``: this process
            was replaced by another incarnation of its learner).
        pace: Stamped when the loop asks for a batch and when it gets it: the loop's pace, which the
            loaders claim by (``queue.pacing``). Given to the iterator the loop itself holds.
        on_end: Called once when the batches run out (not after an error or ``close``).
    """

    watch: BatchWatch | None = None
    guard: Callable[[], None] | None = None
    pace: BufferGauge | None = None
    on_end: Callable[[], None] | None = None


class Batches(Iterator[Batch]):
    """Base of the iterators ``shared_queue`` yields; ends for good after an error or ``close``.

    Subclasses implement ``_next`` (one item from the pump) and ``close``, and pass their
    ``hooks`` on.
    """

    def __init__(self, hooks: LoopHooks | None = None) -> None:
        self._finished = False
        self._hooks = hooks if hooks is not None else LoopHooks()

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> Batch:
        if self._finished:
            raise StopIteration
        hooks = self._hooks
        pace = hooks.pace
        if pace is not None:
            pace.asked()
        if hooks.guard is not None:
            try:
                hooks.guard()
            except BaseException:
                self._finished = True
                raise
        watch = hooks.watch
        if watch is not None:
            watch.ended()  # the loop asks for a batch: it has trained the previous one
        try:
            item = self._next()
            if pace is not None:
                pace.returned()
            return item if watch is None else watched(watch, item)
        except StopIteration:
            self._finished = True
            if hooks.on_end is not None:
                hooks.on_end()
            raise
        except BaseException:
            self._finished = True
            raise

    def _next(self) -> Batch | Item:
        raise NotImplementedError

    def close(self) -> None:
        """Stop the pump and release what it holds; the iterator then ends."""
        raise NotImplementedError


def watched(watch: BatchWatch, item: Item) -> Batch | Item:
    """Tell ``watch`` which unit ``item``'s batch belongs to; the loop's pair, or the item
    whole when its progress is recorded (a claim token: ``ElasticBatches`` takes it)."""
    tag = item.tag
    if not tag.end:
        watch.taken(tag.unit)
    return item if tag.token is not None else item.pair


class ElasticBatches(Batches):
    """Strips the elastic tags and tells the ``ProgressTracker`` what the loop consumed.

    Args:
        inner: The pump's batches, tagged.
        tracker: Records progress and renews the lease; closed with these batches.
        stop_claiming: Called on ``close``, so a claimer waiting for orphans stops waiting.
        hooks: What the loop's iterator calls around each batch (the pace, guard and end; the
            unit timing stays with ``inner``, which sees the tags).
    """

    def __init__(
        self,
        inner: Batches,
        tracker: ProgressTracker,
        stop_claiming: Callable[[], None],
        *,
        hooks: LoopHooks | None = None,
    ) -> None:
        super().__init__(hooks)
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
