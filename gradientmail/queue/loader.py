"""The DataLoader-worker pump (``workers >= 1``) and its clean shutdown.

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
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from gradientmail.errors import InProcessMailboxError, UnpicklableError
from gradientmail.mailbox.base import describe
from gradientmail.mailbox.memory import MemoryMailbox
from gradientmail.queue.batch_checks import Batch, Item, keep_pairs
from gradientmail.queue.consume import Batches, LoopHooks
from gradientmail.queue.dataset import SharedQueueDataset
from gradientmail.queue.handoff import HandOff
from gradientmail.queue.worker_control import WorkerControl

__all__ = [
    "check_for_workers",
    "LoaderBatches",
    "wake_loader",
]


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
        hooks: LoopHooks | None = None,
    ) -> None:
        super().__init__(hooks)
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
    # torch private method in the package.
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
