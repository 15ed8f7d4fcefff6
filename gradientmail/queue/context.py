"""``shared_queue(...)``: the design note's context manager over a ``SharedQueueDataset``.

A bounded prefetch buffer, clean shutdown and errors delivered in order; ``docs/queue.md``
lists its guarantees in full.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import multiprocessing
import multiprocessing.context
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, Generic, ParamSpec, TypeVar

from gradientmail.layout import CLAIMS_PREFIX
from gradientmail.mailbox.base import Mailbox, describe
from gradientmail.meeting_point import meeting_point
from gradientmail.presence import QUEUE, PresenceShare, presence_renew_s
from gradientmail.queue.batch_checks import Batch, checked_count
from gradientmail.queue.batches import TensorTree
from gradientmail.queue.claim_ahead import DEFAULT_CLAIM_AHEAD
from gradientmail.queue.consume import Batches, ElasticBatches, LoopHooks
from gradientmail.queue.dataset import SharedQueueDataset
from gradientmail.queue.group import (
    FollowerBatches,
    LeaderBatches,
    LeaderLoad,
    Split,
    refuse,
    split_rows,
    tagged_units,
)
from gradientmail.queue.loader import LoaderBatches, check_for_workers
from gradientmail.queue.pacing import BufferGauge
from gradientmail.queue.progress import ProgressTracker
from gradientmail.queue.progress_display import ProgressDisplay
from gradientmail.queue.thread_pump import ThreadBatches
from gradientmail.queue.unfinished import warn_unclean, warn_unfinished
from gradientmail.queue.unit_timing import BatchWatch, unit_times
from gradientmail.run_record import prepare_mailbox
from gradientmail.session.group import GroupSync

__all__ = ["WITH_HINT", "QueueContext", "shared_queue"]

V = TypeVar("V")
T = TypeVar("T")
P = ParamSpec("P")

log = logging.getLogger("gradientmail.queue")
"""Run start and end at INFO, each unit claimed and loaded at DEBUG; no handlers configured."""

WITH_HINT = (
    "shared_queue(...) is a context manager, not an iterable: write "
    "`with shared_queue(...) as batches:` and iterate `batches` inside the block (leaving it "
    "stops the loaders cleanly)"
)


class QueueContext(contextlib.AbstractContextManager, Generic[T]):
    """What ``shared_queue(...)`` returns: a context manager that says so when iterated.

    Raises:
        TypeError: on ``iter``/``next`` (``WITH_HINT``): the ``with`` was forgotten.
    """

    def __init__(self, manager: contextlib.AbstractContextManager[T]) -> None:
        self._manager = manager

    def __enter__(self) -> T:
        return self._manager.__enter__()

    def __exit__(self, *exc_info: Any) -> bool | None:
        return self._manager.__exit__(*exc_info)

    def __iter__(self) -> Iterator[Any]:
        raise TypeError(WITH_HINT)

    def __next__(self) -> Any:
        raise TypeError(WITH_HINT)


MAX_PREFETCH = 4096
"""The most batches ``prefetch`` may buffer: far past what keeps a loop fed, short of what
would make the DataLoader queue requests for ever before yielding one."""


def _with_only(function: Callable[P, Iterator[T]]) -> Callable[P, QueueContext[T]]:
    """``contextlib.contextmanager``, returning a ``QueueContext``."""
    manager = contextlib.contextmanager(function)

    @functools.wraps(function)
    def make(*args: P.args, **kwargs: P.kwargs) -> QueueContext[T]:
        return QueueContext(manager(*args, **kwargs))

    return make


@_with_only
def shared_queue(
    units: Mapping[str, V],
    *,
    mailbox: Mailbox,
    learner_id: str | None = None,
    load: Callable[[V], Iterable[tuple[int, TensorTree]]],
    prefetch: int = 8,
    workers: int = 1,
    order: Sequence[str] | None = None,
    pin_memory: bool = False,
    multiprocessing_context: str | multiprocessing.context.BaseContext | None = None,
    shutdown_timeout: timedelta | float | None = None,
    resume: bool | None = None,
    lease: timedelta | float | None = None,
    claim_ahead: int = DEFAULT_CLAIM_AHEAD,
    progress: bool = False,
    group: Any = None,
    split: Split | None = split_rows,
) -> Iterator[Iterator[Batch]]:
    """Consume a shared queue of work units: ``with shared_queue(...) as batches:``.

    Yields an iterator of ``(step, batch)``. Claiming and loading run ahead of the loop in
    ``workers`` DataLoader worker processes (0: one thread here), at most ``prefetch`` batches
    in all; every unit is loaded by exactly one claimer of all nodes; leaving the block stops
    the loaders cleanly. The guarantees in full: ``docs/queue.md``.

    Args:
        units, mailbox, learner_id, load, order, resume, lease: as for ``SharedQueueDataset``.
        prefetch: Batches buffered ahead of the loop, in all (>= ``workers``). Near the end of
            a run a new unit is claimed just in time for the loop instead of whenever the
            buffer has room, so small units go to whichever node starts them first
            (``queue.pacing``).
        workers: DataLoader worker processes; 0 runs on a thread in this process.
        pin_memory: Passed to the DataLoader (needs ``workers >= 1``).
        multiprocessing_context: Start method for workers (default: Python's default).
        shutdown_timeout: Longest wait for an operation in flight when leaving the block.
        claim_ahead: Most claims in flight ahead of the unit being loaded (0: on demand).
        progress: Show units taken and batches/s on stderr.
        group: A ``torch.distributed`` process group whose ranks train one model in lockstep
            (DDP): one learner of the queue. Its rank 0 claims (the other ranks never touch the
            mailbox) and every rank gets its share of every batch, ending at the same step.
            Every rank passes the same ``units`` and ``load``, and leaves the loop at the same
            step (``break`` on all or none).
        split: ``split(batch, rank, size)``, a rank's share of a whole batch (with ``group``);
            default ``split_rows``, near-equal blocks of rows. ``None``: ``load`` already
            yields this rank's share (it must yield the same steps on every rank).

    Raises:
        RunMismatchError: the prefix holds a run of another unit set.
        DuplicateLearnerError: another live process runs ``learner_id`` in this mailbox.
        InProcessMailboxError: a ``MemoryMailbox`` with ``workers > 0``.
        UnpicklableError: what workers receive cannot be pickled under this start method.

    Example:
        >>> import torch
        >>> from gradientmail.mailbox import MemoryMailbox
        >>> load = lambda n: [(0, torch.tensor([n]))]
        >>> units = {"a": 1, "b": 2}
        >>> box = MemoryMailbox("doctest-shared-queue")
        >>> with shared_queue(units, mailbox=box, learner_id="n0", load=load, workers=0) as batches:
        ...     sorted(int(batch) for step, batch in batches)
        [1, 2]
    """
    prefetch = checked_count("prefetch", prefetch, 1)
    if group is not None:
        sync = GroupSync(group)
        if not sync.leads:  # loads what rank 0 claimed; nothing on the store
            follower = FollowerBatches(units, load, split, sync, prefetch)
            try:
                yield follower
                follower.leave()
            finally:
                follower.close()
            return
        tagged = tagged_units(units)
        leader_load = LeaderLoad(load, split, sync.size)
        with contextlib.ExitStack() as stack:
            try:
                inner = stack.enter_context(
                    shared_queue(
                        tagged,
                        mailbox=mailbox,
                        learner_id=learner_id,
                        load=leader_load,
                        prefetch=prefetch,
                        workers=workers,
                        order=order,
                        pin_memory=pin_memory,
                        multiprocessing_context=multiprocessing_context,
                        shutdown_timeout=shutdown_timeout,
                        resume=resume,
                        lease=lease,
                        claim_ahead=claim_ahead,
                        progress=progress,
                    )
                )
            except BaseException:
                refuse(sync)  # refused before its first batch: the other ranks raise with it
                raise
            leader = LeaderBatches(inner, sync, leader_load.started)
            yield leader
            leader.leave()
        return
    if prefetch > MAX_PREFETCH:
        raise ValueError(
            f"prefetch must be <= {MAX_PREFETCH}, not {prefetch}: it is the number of batches held in "
            "memory at once (and the DataLoader asks for that many up front); a few per worker keep "
            "the loop fed"
        )
    workers = checked_count("workers", workers, 0)
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be True or False, not {type(progress).__name__} {progress!r}")
    if prefetch < workers:
        raise ValueError(
            f"prefetch={prefetch} is below workers={workers}: every worker needs room for at "
            "least one batch, and prefetch bounds the batches buffered in all; raise prefetch "
            "or lower workers"
        )
    timeout = _seconds(shutdown_timeout)
    dataset = SharedQueueDataset(
        units,
        mailbox=mailbox,
        learner_id=learner_id,
        load=load,
        order=order,
        resume=resume,
        lease=lease,
        claim_ahead=claim_ahead,
    )
    context = None
    if workers > 0:
        context = _start_context(multiprocessing_context)
        check_for_workers(dataset, context)
    if not dataset.units:
        yield iter(())
        return
    prepare_mailbox(mailbox, len(dataset.units), dataset.units)
    # One incarnation for this node's workers and its tracker; the presence record is this
    # process's for the learner, shared with its Session (whose incarnation it names if that
    # started first).
    elastic = dataset.elastic
    presence = PresenceShare(
        mailbox,
        dataset.learner_id,
        QUEUE,
        incarnation=elastic.incarnation if elastic is not None else None,
        renew_s=presence_renew_s(dataset.lease_s),
    )
    presence.start()  # DuplicateLearnerError before anything is claimed or recorded
    if elastic is None:  # units an earlier run of this learner left are not taken back: say so
        if dataset.marks_loading:
            warn_unfinished(mailbox, dataset.learner_id, dataset.incarnation)
        else:
            warn_unclean(dataset.learner_id, presence.previous)
    watch = BatchWatch(unit_times(meeting_point(mailbox, dataset.learner_id)))
    display: ProgressDisplay | None = None
    began = time.monotonic()
    try:
        if progress:  # before any claim: a missing rich fails here, not in the loop
            display = _progress_display(dataset, watch)
        log.info(
            "%s: shared queue on %s: %d units, mode %s, workers %d, prefetch %d, claim_ahead %d",
            dataset.learner_id,
            describe(mailbox),
            len(dataset.units),
            _mode(dataset),
            workers,
            prefetch,
            dataset.claim_ahead if elastic is None or (elastic.automatic and elastic.lease_s is None) else 0,
        )
        tracker: ProgressTracker | None = None
        if elastic is not None:
            # Its own earlier units continue from the marks its Session's counts continue from.
            joined = meeting_point(mailbox, dataset.learner_id).gate.take_join_marks()
            elastic = dataclasses.replace(elastic, joined_marks=joined)
            # The lease exists before the first claim.
            tracker = ProgressTracker(mailbox, dataset.learner_id, elastic)
            tracker.start()
        dataset = dataset.configured(
            elastic=elastic,
            prepared=True,
            timed=True,
            tagged=tracker is not None,
            gauge=BufferGauge(max(1, workers), prefetch),
        )
        # The loop's own iterator paces, guards and ends; with a tracker that is the elastic
        # layer, and the pump under it only times units (it sees their tags).
        loop_hooks = LoopHooks(pace=dataset.gauge, guard=presence.check, on_end=_warn_if_nothing_claimed(dataset))
        pump_hooks = LoopHooks(watch=watch) if tracker is not None else dataclasses.replace(loop_hooks, watch=watch)
        batches: Batches
        if workers == 0:
            batches = ThreadBatches(dataset, prefetch, timeout, hooks=pump_hooks)
        else:
            assert context is not None
            batches = LoaderBatches(
                dataset,
                prefetch=prefetch,
                workers=workers,
                context=context,
                pin_memory=pin_memory,
                timeout=timeout,
                hooks=pump_hooks,
            )
        if tracker is None:
            try:
                yield batches
            finally:
                watch.ended()  # the last batch's training ends here, not after the shutdown
                batches.close()
            return
        consumed = ElasticBatches(batches, tracker, dataset.stop_claiming, hooks=loop_hooks)
        clean = False
        try:
            yield consumed
            clean = True
        finally:
            watch.ended()
            if clean:
                consumed.close(consumed_last=True)
            else:
                try:
                    consumed.close(consumed_last=False, replaced=presence.replaced)
                except Exception as exc:  # do not hide the error that is leaving the block
                    warnings.warn(f"shared_queue: recording progress on exit failed: {exc!r}", stacklevel=3)
    finally:
        if display is not None:
            display.close()
        conflicts = dataset.claim_stats["conflicts"]  # workers count their own (logged there)
        log.info(
            "%s: left the shared queue after %.1fs: %d batches of %d units trained, %d units claimed by this learner%s",
            dataset.learner_id,
            time.monotonic() - began,
            watch.batches,
            watch.units,
            dataset.units_claimed(),
            f", {conflicts} conflicts" if workers == 0 else "",
        )
        presence.close()


def _start_context(value: Any) -> multiprocessing.context.BaseContext:
    if value is None or isinstance(value, str):
        return multiprocessing.get_context(value)
    if isinstance(value, multiprocessing.context.BaseContext):
        return value
    raise TypeError(f"multiprocessing_context must be None, a start method name or a context, not {value!r}")


def _seconds(value: timedelta | float | None) -> float | None:
    if value is None:
        return None
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if seconds < 0:
        raise ValueError(f"shutdown_timeout must be >= 0, not {value}")
    return seconds


def _warn_if_nothing_claimed(dataset: SharedQueueDataset[Any]) -> Callable[[], None]:
    """Say why a node got no batch at all: a rerun into a finished prefix looks like success."""

    def check() -> None:
        if dataset.units_claimed() == 0:  # claims of this queue, its worker processes included
            run = f"every unit of this run ({len(dataset.units)} units in {describe(dataset.mailbox)})"
            if dataset.elastic is None:
                why = (
                    f"{run} is already taken or done (claims are permanent: to train these units "
                    "again, use a fresh prefix)"
                )
            else:
                if dataset.elastic.automatic and dataset.lease_s is None:
                    why = (
                        f"{run} is already taken or done (a unit left unfinished goes back only to "
                        "its own learner_id; `gradientmail status` shows who holds what; to train "
                        "these units again, use a fresh prefix)"
                    )
                    warnings.warn(f"shared_queue: 0 batches for learner {dataset.learner_id!r}: {why}", stacklevel=3)
                    return
                mine = "none of this learner's earlier units was left unfinished, and " if dataset.resume else ""
                why = (
                    f"{mine}{run} is done or held by a live node: nothing is left for this node "
                    "(a dead node's units go to live ones after its lease; `gradientmail status` "
                    "shows who holds what)"
                )
            warnings.warn(
                f"shared_queue: 0 batches for learner {dataset.learner_id!r}: {why}",
                stacklevel=3,  # the training loop's line
            )

    return check


def _mode(dataset: SharedQueueDataset[Any]) -> str:
    if dataset.elastic is None:
        return "plain queue (resume=False)"
    if dataset.elastic.automatic and dataset.lease_s is None:
        return "resume (automatic)"
    parts = ["resume"] if dataset.resume else []
    return "+".join([*parts, *(["lease"] if dataset.lease_s is not None else [])])


def _progress_display(dataset: SharedQueueDataset[Any], watch: BatchWatch) -> ProgressDisplay:
    """Start ``shared_queue``'s progress display; counts come from memory, the run's from a listing."""
    mailbox = dataset.mailbox

    def run_taken() -> int:
        return sum(1 for _ in mailbox.list(CLAIMS_PREFIX))

    display = ProgressDisplay(
        learner_id=dataset.learner_id,
        total=len(dataset.units),
        mine=dataset.units_claimed,
        batches=lambda: watch.batches,
        run_taken=run_taken,
    )
    display.start()
    return display
