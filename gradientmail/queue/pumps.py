"""The pumps from loader to loop: the thread pump, the DataLoader-worker pump, the loop's iterator.

Section ``consume`` below: The iterator the training loop sees: ends for good, times units, and (elastic) records progress.

Data flows one way: a pump (``ThreadBatches``, ``LoaderBatches``) delivers
``batches.Item``s (a batch and its unit's ``UnitTag``); ``Batches`` times them per unit, and
``ElasticBatches`` on top hands the tags to ``progress.Consumption``: the loop gets plain pairs.

The thread pump: ``ThreadBatches`` (``workers=0``) runs the dataset's claiming and loading on a
``handoff.HandOff``; ``LoaderBatches`` uses one to take DataLoader's batches off the training thread.

Section ``loader`` below: The DataLoader-worker pump (``workers >= 1``) and its clean shutdown.

Each worker claims and loads for itself; a ``WorkerControl`` lets ``close`` stop every worker
between operations, and a ``HandOff`` takes batches off the training thread.
"""

from __future__ import annotations

import functools
import inspect
import multiprocessing.context
import pickle
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader

from gradientmail.errors import InProcessMailboxError, UnpicklableError
from gradientmail.mailbox.base import describe
from gradientmail.mailbox.memory import MemoryMailbox
from gradientmail.queue.batches import Batch, Item, keep_pairs
from gradientmail.queue.dataset import SharedQueueDataset, WorkerControl
from gradientmail.queue.handoff import HandOff
from gradientmail.queue.pacing import BufferGauge
from gradientmail.queue.progress import Consumption, ProgressTracker
from gradientmail.queue.telemetry import BatchWatch

__all__ = [
    "Batches",
    "ElasticBatches",
    "LoaderBatches",
    "ThreadBatches",
    "check_for_workers",
    "wake_loader",
    "watched",
]


# -- consume -----------------------------------------------------------------------------------------


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

    pace: BufferGauge | None = None
    """Stamped when the loop asks for a batch and when it gets it: the loop's pace, which the
    loaders claim by (``queue.pacing``). Set on the iterator the loop itself holds."""

    def __init__(self) -> None:
        self._finished = False

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> Batch:
        if self._finished:
            raise StopIteration
        pace = self.pace
        if pace is not None:
            pace.asked()
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
            if pace is not None:
                pace.returned()
            return item if watch is None else watched(watch, item)
        except StopIteration:
            self._finished = True
            if self.on_end is not None:
                self.on_end()
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


# -- thread pump ---------------------------------------------------------------------------------------


class ThreadBatches(Batches):
    """``workers=0``: claims and loads on one background thread, ``prefetch`` batches ahead."""

    def __init__(self, dataset: SharedQueueDataset[Any], prefetch: int, timeout: float | None) -> None:
        super().__init__()
        self._timeout = timeout
        self._gauge = dataset.gauge
        self._source = iter(dataset)
        # A daemon: never keeps the interpreter alive; close() joins it.
        self._pump = HandOff(self._source, prefetch, f"gradientmail-shared-queue-{dataset.learner_id}")

    def _next(self) -> Batch | Item:
        batch = self._pump.take()
        if self._gauge is not None:
            self._gauge.consumed()
        return batch

    def close(self) -> None:
        """Stop the thread, then close the dataset's iterator (waiting up to ``timeout``)."""
        self._finished = True
        if self._gauge is not None:
            self._gauge.close()  # a loader waiting for its turn to claim leaves at once
        self._pump.stop()
        if self._pump.finish(self._timeout, self._close_source):
            self._close_source()
            return
        warnings.warn(
            f"shared_queue: the loader thread did not finish its operation within "
            f"{self._timeout} s (shutdown_timeout); leaving it to finish in the background",
            stacklevel=2,
        )

    def _close_source(self) -> None:
        try:
            close = getattr(self._source, "close", None)
            if close is not None:
                close()  # the loader's own cleanup (a generator's finally blocks)
        except Exception as exc:  # the consumer has moved on; do not lose it silently
            warnings.warn(f"shared_queue: the loader failed while closing: {exc!r}", stacklevel=1)


# -- loader ------------------------------------------------------------------------------------------

_HAS_IN_ORDER = "in_order" in inspect.signature(DataLoader.__init__).parameters


class LoaderBatches(Batches):
    """``workers >= 1``: a DataLoader whose workers claim and load, ``prefetch`` batches in all.

    ``prefetch`` rounds down to a multiple of ``workers`` (DataLoader's places are per worker);
    each worker's last place moves to a ``HandOff`` (none when ``prefetch < 2 * workers``).
    """

    def __init__(
        self,
        dataset: SharedQueueDataset[Any],
        *,
        prefetch: int,
        workers: int,
        context: multiprocessing.context.BaseContext,
        pin_memory: bool,
        timeout: float | None,
    ) -> None:
        super().__init__()
        self._timeout = timeout
        self._control = WorkerControl(context, workers)
        # A copy: the caller's dataset stays usable on its own.
        dataset = dataset.configured(control=self._control, prepared=True)
        self._gauge = dataset.gauge
        # prefetch_factor is per worker: the total in flight stays <= prefetch. A worker with
        # two places or more gives its last one to the hand-off (the total is unchanged).
        per_worker = prefetch // workers
        slots = workers if per_worker > 1 else 0
        options: dict[str, Any] = {
            "batch_size": None,
            "num_workers": workers,
            "prefetch_factor": per_worker - 1 if slots else per_worker,
            "collate_fn": keep_pairs,
            "persistent_workers": False,
            "pin_memory": pin_memory,
            "multiprocessing_context": context,
        }
        if _HAS_IN_ORDER:
            # Hand out each batch as soon as any worker has it: with DataLoader's default
            # round-robin a fast worker would wait for a slow one.
            options["in_order"] = False
        self._iterator: Any = iter(DataLoader(dataset, **options))
        self._pump: HandOff | None = None
        if slots:
            self._pump = HandOff(self._iterator, slots, f"gradientmail-handoff-{dataset.learner_id}")

    @property
    def handoff(self) -> HandOff | None:
        """The thread that takes batches from the workers (None with one place per worker)."""
        return self._pump

    @property
    def control(self) -> WorkerControl:
        """Shared with the workers; ``control.stop`` is set when the batches are closed."""
        return self._control

    def _next(self) -> Batch | Item:
        if self._iterator is None:
            raise StopIteration
        batch = next(self._iterator) if self._pump is None else self._pump.take()
        if self._gauge is not None:
            self._gauge.consumed()
        return batch

    def close(self) -> None:
        """Stop the workers between operations (up to ``timeout``), then shut the DataLoader down."""
        self._finished = True
        iterator, self._iterator = self._iterator, None
        if iterator is None:
            return
        pump, self._pump = self._pump, None
        self._control.stop.set()
        if self._gauge is not None:
            self._gauge.close()
        if pump is not None:
            pump.stop()
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        processes = list(getattr(iterator, "_workers", ()))
        for worker, lock in enumerate(self._control.locks):
            process = processes[worker] if worker < len(processes) else None
            _wait_for_operation(lock, process, deadline)
        # Every worker is now between operations and will do no more, so a pump inside next()
        # gets their end (or a batch) and leaves; only then may this thread use the iterator.
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        shut_down = functools.partial(_shut_down, iterator)
        if pump is not None and not pump.finish(remaining, shut_down, functools.partial(wake_loader, iterator)):
            warnings.warn(
                "shared_queue: the hand-off thread is still waiting for a worker; it shuts the "
                "DataLoader down when that returns",
                stacklevel=2,
            )
            return
        shut_down()


def wake_loader(iterator: Any) -> None:
    """Make a thread blocked in a DataLoader iterator's ``next()`` raise (``idx, data = None``)."""
    data_queue = getattr(iterator, "_data_queue", None)
    if data_queue is not None:
        data_queue.put(None)


def _shutdown_workers(iterator: Any) -> None:
    # DataLoader's iterator has no public shutdown: __del__ calls this same method, but only once
    # the last reference is gone, and the hand-off thread may still hold one. The one use of a
    # torch private method in the package (issue #15: flagged for the lead).
    iterator._shutdown_workers()


def _shut_down(iterator: Any) -> None:
    # DataLoader's own shutdown only has to collect the workers (it would SIGTERM one still
    # busy after 5 s).
    _shutdown_workers(iterator)
    for queue in [*getattr(iterator, "_index_queues", ()), getattr(iterator, "_worker_result_queue", None)]:
        feeder = getattr(queue, "_thread", None)
        if feeder is not None:
            queue.close()  # done by the shutdown, except for the result queue wake_loader put into
            feeder.join(1.0)


def _wait_for_operation(lock: Any, process: Any, deadline: float | None) -> None:
    while True:
        if lock.acquire(timeout=0.05):
            lock.release()
            return
        if process is not None and not process.is_alive():
            return  # a dead worker cannot release its lock
        if deadline is not None and time.monotonic() >= deadline:
            warnings.warn(
                "shared_queue: a worker did not finish its operation within shutdown_timeout; "
                "DataLoader will terminate it",
                stacklevel=3,
            )
            return


def _inner_mailboxes(mailbox: object) -> Iterator[object]:
    seen = 0
    while mailbox is not None and seen < 32:  # wrappers hold the wrapped mailbox in .inner
        yield mailbox
        mailbox = getattr(mailbox, "inner", None)
        seen += 1


def check_for_workers(dataset: SharedQueueDataset[Any], context: multiprocessing.context.BaseContext) -> None:
    """Refuse what worker processes cannot share: an in-process mailbox, or (without fork)
    ``load``, units or mailbox that cannot be pickled.

    Raises:
        InProcessMailboxError: the mailbox (or one it wraps) is a ``MemoryMailbox``.
        UnpicklableError: something the workers receive cannot be pickled.
    """
    for mailbox in _inner_mailboxes(dataset.mailbox):
        if isinstance(mailbox, MemoryMailbox):
            raise InProcessMailboxError(
                f"{describe(mailbox)} lives in this process, but workers > 0 starts worker "
                "processes that would each get a private copy and claim units nobody else "
                "sees. Use workers=0, or a LocalMailbox / S3 mailbox that every process can reach"
            )
    method = context.get_start_method()
    if method == "fork":
        return  # workers inherit everything; nothing is pickled
    for what, value in (("load", dataset.load), ("the unit values", dataset.units), ("the mailbox", dataset.mailbox)):
        try:
            pickle.dumps(value)
        except Exception as exc:
            raise UnpicklableError(
                f"{what} cannot be pickled ({type(exc).__name__}: {exc}), but DataLoader workers "
                f"started with {method!r} receive it pickled. Use workers=0, or a module-level "
                "function (not a lambda, closure or nested function) and picklable values"
            ) from exc
