"""The shared queue: nodes of unequal speed drain one set of work units through a mailbox.

Every node holds the same mapping of unit identifiers to unit values. It claims units one at a
time (``gradientmail.patterns.claims``: an atomic create of ``units/{identifier}``, read back)
and loads the batches of each unit it owns, so a fast node simply takes more units and the run
ends when the work ends, not when the slowest node's fixed share does.

- ``SharedQueueDataset``: a ``torch.utils.data.IterableDataset`` that claims and loads; use it
  directly or in your own ``DataLoader``.
- ``shared_queue``: the seed's context manager, a ``DataLoader`` over that dataset with a bounded
  prefetch buffer, clean shutdown and errors delivered in order (``workers=0``: one background
  thread in this process).
- ``units_claimed_by(learner_id)``: units claimed in this process (and its DataLoader workers).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import functools
import inspect
import logging
import multiprocessing
import multiprocessing.context
import numbers
import pickle
import threading
import time
import uuid
import warnings
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, Generic, ParamSpec, TypeVar

import torch
from torch.utils.data import DataLoader, IterableDataset, _utils, get_worker_info

from gradientmail.errors import GradientMailError, LoaderError, UnsafeStoreError, WrongProcessError
from gradientmail.layout import CLAIMS_PREFIX, RUN_KEY
from gradientmail.mailbox.base import Mailbox, describe, require_replace_if, verify_mailbox
from gradientmail.mailbox.memory import MemoryMailbox
from gradientmail.patterns.batches import TensorTree, first_non_tensor
from gradientmail.patterns.claim_ahead import DEFAULT_CLAIM_AHEAD, BufferGauge, ClaimAhead
from gradientmail.patterns.claims import (
    DEFAULT_LISTING,
    LISTING_POLICIES,
    Claimer,
    ClaimIndex,
    validate_identifiers,
    validate_learner_id,
)
from gradientmail.patterns.elastic import (
    BATCH,
    Consumption,
    ElasticClaimer,
    ElasticOptions,
    ProgressTracker,
    check_elastic,
    consume_inline,
    tagged_items,
)
from gradientmail.patterns.inline import inline
from gradientmail.patterns.presence import Presence, presence_renew_s
from gradientmail.patterns.progress_display import ProgressDisplay
from gradientmail.patterns.unit_timing import BatchWatch, unit_times
from gradientmail.run_record import check_run_record, run_record, unit_fingerprint

__all__ = [
    "InProcessMailboxError",
    "SharedQueueDataset",
    "UnpicklableError",
    "shared_queue",
    "units_claimed_by",
]

V = TypeVar("V")
Batch = tuple[int, TensorTree]

_HAS_IN_ORDER = "in_order" in inspect.signature(DataLoader.__init__).parameters

log = logging.getLogger("gradientmail.queue")
"""Run start and end at INFO, each unit claimed and loaded at DEBUG; no handlers configured."""


class InProcessMailboxError(WrongProcessError, ValueError):
    """A ``MemoryMailbox`` was given to worker processes, which would each get a private copy."""


class UnpicklableError(GradientMailError, TypeError, pickle.PicklingError):
    """``load``, the units or the mailbox cannot be sent to workers under this start method."""


# -- units claimed per learner, across this process and its DataLoader workers ------------------

_SLOTS = 256
"""Counter slots per dataset: 0 for this process, 1 + worker id for DataLoader workers."""

_COUNTERS: dict[str, list[_ClaimCounter]] = {}
_COUNTERS_LOCK = threading.Lock()


class _ClaimCounter:
    """Units claimed through one dataset, in shared memory that worker processes write to.

    Each worker writes only its own slot, so no lock crosses processes; a plain shared array
    also works whatever start method the DataLoader uses (a ``multiprocessing.Value`` made for
    one start method cannot be sent to processes of another).
    """

    def __init__(self) -> None:
        self._slots = multiprocessing.RawArray(ctypes.c_int64, _SLOTS)
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"_slots": self._slots}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._slots = state["_slots"]
        self._lock = threading.Lock()

    def add(self, worker: int | None) -> None:
        if worker is not None:
            # A worker process is the only writer of its slot (ids beyond the slots share one:
            # counts may then be approximate).
            self._slots[1 + worker % (_SLOTS - 1)] += 1
            return
        with self._lock:  # several iterators may run in threads of this process
            self._slots[0] += 1

    def total(self) -> int:
        return sum(self._slots)


def _register_counter(learner_id: str) -> _ClaimCounter:
    counter = _ClaimCounter()
    with _COUNTERS_LOCK:
        _COUNTERS.setdefault(learner_id, []).append(counter)
    return counter


def units_claimed_by(learner_id: str) -> int:
    """Units that ``learner_id`` claimed through queues created in this process.

    Counts claims made here and in the DataLoader worker processes of those queues (including
    ``SharedQueueDataset`` in your own ``DataLoader``); 0 for a learner this process never ran.
    A ``Session`` reports it as ``"units"`` in the learner's progress record.
    """
    with _COUNTERS_LOCK:
        counters = list(_COUNTERS.get(learner_id, ()))
    return sum(counter.total() for counter in counters)


# -- the dataset -------------------------------------------------------------------------------


def prepare_mailbox(mailbox: Mailbox, units: int, identifiers: Iterable[str] | None = None) -> None:
    """Record the run (``run.json``) if new, and refuse a store without atomic creation.

    With ``identifiers`` the record carries the unit set's fingerprint, and joining a run of
    another unit set raises ``RunMismatchError`` (``gradientmail.run_record``).

    Only the node that creates ``run.json`` runs the full store check (``verify_mailbox``: a
    probe key created twice, read back and deleted, four requests). Every other node has just
    watched the store refuse a duplicate create of ``run.json``, which is the evidence that
    check looks for; it reads ``run.json`` back (one request) to confirm the key it was refused
    exists, so a store that reports every create as refused is caught too. A store that
    ignores If-None-Match reports every create of ``run.json`` as done, so every node runs the
    full check and is refused before it claims anything. Five requests for the first node,
    two for each of the others (the seed checked the store on every node: five each).
    """
    fingerprint = unit_fingerprint(identifiers) if identifiers is not None else None
    if mailbox.put_if_absent(RUN_KEY, run_record(units, fingerprint)):
        verify_mailbox(mailbox)
        return
    existing = mailbox.get(RUN_KEY)
    if existing is None:
        store = describe(mailbox)
        raise UnsafeStoreError(
            f"{store}: creating {RUN_KEY!r} reported that it already existed, but it cannot be "
            "read; put_if_absent does not report creation truthfully",
            operation="verify",
            key=RUN_KEY,
            store=store,
        )
    check_run_record(existing, units, fingerprint, describe(mailbox))


class _Control:
    """What ``shared_queue`` shares with its worker processes to stop them between operations.

    ``stop`` ends claiming and loading; each worker holds its ``locks[worker]`` around every
    step of its claim/load generator, so acquiring a worker's lock waits for the operation in
    flight to finish instead of interrupting it.
    """

    def __init__(self, context: multiprocessing.context.BaseContext, workers: int) -> None:
        self.stop = context.Event()
        self.locks = [context.Lock() for _ in range(workers)]


class SharedQueueDataset(IterableDataset[Batch], Generic[V]):
    """Claims work units from a shared mailbox and yields each claimed unit's batches.

    Args:
        units: Identifier → unit value, the same on every node. Identifiers are ``str`` usable
            in a mailbox key (``units/{identifier}``); values are anything ``load`` accepts (and
            picklable, for worker processes that do not fork). The library never reads them.
        mailbox: The mailbox every node shares (``LocalMailbox``, ``S3Mailbox``, ...).
        learner_id: This node's name, e.g. ``f"node-{rank}"``: a non-empty key segment.
        load: ``load(value)`` yields ``(step, batch)`` pairs for one unit, in step order; a
            batch is a tensor, or tuples, lists and dicts of tensors nested to any depth
            (``gradientmail.patterns.batches``).
        order: This node's preference, a permutation of the identifiers (default: the
            mapping's order). ``rotated_order`` makes each node prefer a different lane.
        resume: Record what the training loop consumed and let this learner, restarted, take
            back its unfinished units (and any node take released ones), continuing each after
            its last consumed step (``gradientmail.patterns.elastic``). Needs a store with
            ``replace_if``.
        lease: Renew a heartbeat while batches are consumed, and take over the units of nodes
            whose heartbeat stopped changing for ``lease`` (a ``timedelta``). Needs
            ``replace_if``.
        claim_ahead: Most units to claim ahead of the one being loaded, on background threads,
            so a slow store's round trips overlap loading (``gradientmail.patterns.claim_ahead``).
            0 (default here): claim on demand. In your own ``DataLoader`` every wait for a claim
            counts as the loop starving, so up to ``claim_ahead`` units are claimed ahead of
            each worker once claims are seen to stall it; ``shared_queue`` watches its buffer
            and claims ahead only when the loop was starving while a claim was made. Not used with
            ``resume``, ``lease`` or a restored state (those claim on demand).
        listing: When the claimer lists claims before an attempt (``claims.LISTING_POLICIES``;
            the default suits every store, the others are for comparisons).
        claim_index: A ``ClaimIndex`` of these units to share (building one sorts every key:
            the simulator builds it once for all its nodes); None builds it on first use.
        prepared: The caller already ran ``prepare_mailbox`` on ``mailbox`` for these units,
            as ``shared_queue`` does once per node; iterating then skips it.

    With ``resume`` or ``lease``, consumption is tracked where the dataset is iterated: use it
    through ``shared_queue`` or iterate it directly in the training process (a batch counts as
    consumed when the next one is asked for), not in your own multi-worker ``DataLoader``.
    ``state_dict`` / ``load_state_dict`` (torchdata's ``Stateful``) work without these options.

    Iterating claims the first unit in ``order`` not claimed by anyone, yields its batches,
    then claims the next, until no unclaimed unit is left. Claiming happens inside ``next()``:
    with ``claim_ahead=0`` a unit is claimed only when its first batch is asked for. Each
    iteration first records the run and checks that the store creates atomically
    (``prepare_mailbox``). In
    ``DataLoader(dataset, batch_size=None, num_workers=k)`` every worker claims for itself and
    no two workers load one unit; note that DataLoader's default collation then turns each
    pair, and each plain tuple inside a batch, into a list (dicts and namedtuples stay).
    """

    def __init__(
        self,
        units: Mapping[str, V],
        *,
        mailbox: Mailbox,
        learner_id: str,
        load: Callable[[V], Iterable[tuple[int, TensorTree]]],
        order: Sequence[str] | None = None,
        resume: bool = False,
        lease: timedelta | float | None = None,
        claim_ahead: int = 0,
        listing: str = DEFAULT_LISTING,
        claim_index: ClaimIndex | None = None,
        prepared: bool = False,
    ) -> None:
        super().__init__()
        if listing not in LISTING_POLICIES:
            raise ValueError(f"listing must be one of {LISTING_POLICIES}, not {listing!r}")
        if not isinstance(units, Mapping):
            raise TypeError(f"units must be a mapping of identifier -> unit value, not {type(units).__name__}")
        self.units: dict[str, V] = dict(units)
        validate_identifiers(self.units)
        self.learner_id = validate_learner_id(learner_id)
        if not callable(load):
            raise TypeError(
                f"load must be a callable that yields (step, batch) pairs for a unit, not {type(load).__name__}"
            )
        if not isinstance(mailbox, Mailbox):
            raise TypeError(
                f"mailbox must be a Mailbox (put_if_absent, get, put, list, delete), not {type(mailbox).__name__}"
            )
        self.mailbox = mailbox
        self.load = load
        self.order: list[str] = _checked_order(order, self.units)
        self.claim_ahead = _positive("claim_ahead", claim_ahead, 0)
        self._gauge: BufferGauge | None = None  # shared_queue's buffer, which claim_ahead watches
        self._counter = _register_counter(self.learner_id)
        self._verified = prepared  # shared_queue verifies once in the main process
        self._control: _Control | None = None
        self._listing = listing
        self._claim_index: ClaimIndex | None = claim_index  # built on first use unless shared
        self._claim_stats: Counter[str] = Counter()  # per process; the simulator reads it
        self.resume = resume
        self.lease_s = check_elastic(mailbox, resume, lease)
        self._elastic: ElasticOptions | None = (
            ElasticOptions(resume, self.lease_s) if resume or self.lease_s is not None else None
        )
        self._tagged = False  # shared_queue strips the tags in the training process
        self._timed = False  # shared_queue: plain batches carry their unit (unit_timing)
        self._halt = [False]  # set when the consumer leaves (workers=0 has no _control)
        self._restore: dict[str, dict[str, Any]] = {}
        self._positions: dict[str, dict[str, Any]] = {}  # unit -> token, last step yielded

    def __repr__(self) -> str:
        return (
            f"SharedQueueDataset({len(self.units)} units, learner_id={self.learner_id!r}, "
            f"mailbox={describe(self.mailbox)})"
        )

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker = info.id if info is not None else None
        if self._elastic is not None and not self._tagged:
            if worker is not None:
                raise ValueError(
                    "resume= and lease= record what the training loop consumed, which a "
                    "DataLoader worker cannot see: use shared_queue(...), iterate the dataset "
                    "in the training process, or use state_dict()/load_state_dict() (e.g. "
                    "torchdata's StatefulDataLoader) without these options"
                )
            options = dataclasses.replace(self._elastic, incarnation=uuid.uuid4().hex)
            tracker = ProgressTracker(self.mailbox, self.learner_id, options)
            presence = Presence(
                self.mailbox, self.learner_id, options.incarnation, renew_s=presence_renew_s(options.lease_s)
            )
            return consume_inline(self._claim_and_load(None, options), tracker, presence)
        batches = self._claim_and_load(worker, self._elastic)
        if self._control is None:
            return batches
        return _guarded(batches, self._control, worker or 0)

    # -- torchdata's Stateful protocol ---------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The units this iteration is reading: claim token, last step handed out and its
        position in the unit's ``load`` iteration (which ``load_state_dict`` continues after),
        per unit.

        In a DataLoader worker this is that worker's state (``StatefulDataLoader`` collects
        one per worker along with the batches it delivers).
        """
        return {
            "version": 1,
            "learner_id": self.learner_id,
            "units": {identifier: dict(position) for identifier, position in self._positions.items()},
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Take the units of ``state_dict`` back on the next iteration and continue each after
        its last position (a state without one: after its last step label), by a
        compare-and-swap on the claim: a store with ``replace_if`` is needed."""
        units = state_dict.get("units") if isinstance(state_dict, Mapping) else None
        if not isinstance(units, Mapping):
            raise ValueError(f"not a SharedQueueDataset state_dict (no 'units' mapping): {_describe(state_dict)}")
        if state_dict.get("learner_id") not in (None, self.learner_id):
            raise ValueError(
                f"state_dict of learner {state_dict.get('learner_id')!r} loaded into learner {self.learner_id!r}"
            )
        restore = {str(i): dict(p) for i, p in units.items() if i in self.units and isinstance(p, Mapping)}
        if restore:
            require_replace_if(self.mailbox, "load_state_dict")
        self._restore = restore

    def _claim_and_load(self, worker: int | None, options: ElasticOptions | None = None) -> Iterator[Any]:
        if not self.units:
            return
        if not self._verified:
            prepare_mailbox(self.mailbox, len(self.units), self.units)
        if options is not None or self._restore:
            yield from self._claim_and_load_elastic(worker, options)
            return
        if self._claim_index is None:
            self._claim_index = ClaimIndex(self.units)
        claimer = Claimer(
            self.mailbox,
            self.order,
            self.learner_id,
            worker=worker,
            listing=self._listing,
            index=self._claim_index,
        )
        gauge = self._gauge
        claims = ClaimAhead(
            claimer,
            limit=self.claim_ahead,
            gauge=gauge,
            count=lambda: self._counter.add(worker),
            name=f"gradientmail-claim-{self.learner_id}",
        )
        try:
            while True:
                try:
                    identifier = claims.next()
                except Exception as exc:
                    _note(exc, f"while learner {self.learner_id!r} was claiming a unit in {describe(self.mailbox)}")
                    raise
                if identifier is None:
                    return
                for position, (step, tensor) in enumerate(self._load_unit(identifier)):
                    self._positions[identifier] = {"token": None, "step": step, "position": position}
                    if gauge is not None:
                        gauge.produced(worker)
                    yield (step, tensor, identifier) if self._timed else (step, tensor)
                log.debug(
                    "%s loaded unit %s (%d batches)",
                    self.learner_id,
                    identifier,
                    self._positions.get(identifier, {}).get("position", -1) + 1,
                )
                self._positions.pop(identifier, None)
        finally:
            claims.close()
            self._claim_stats.update(claimer.stats)
            _log_claims(self.learner_id, worker, claimer.stats)

    def _claim_and_load_elastic(self, worker: int | None, options: ElasticOptions | None) -> Iterator[Any]:
        """Resume, leases or a restored state: ``ElasticClaimer`` picks the units.

        With ``options`` the items are tagged for the consumer's ``ProgressTracker``; a plain
        restore (``load_state_dict`` without resume or lease) yields plain pairs.
        """
        control = self._control
        halt = self._halt
        claimer = ElasticClaimer(
            self.mailbox,
            self.order,
            self.learner_id,
            options or ElasticOptions(resume=False, lease_s=None),
            worker=worker,
            listing=self._listing,
            restore=self._restore,
            stopping=lambda: halt[0] or (control is not None and control.stop.is_set()),
        )
        self._restore = {}
        try:
            items = tagged_items(claimer, self._load_unit, lambda: self._counter.add(worker))
            while True:
                try:
                    item = next(items)
                except StopIteration:
                    return
                except Exception as exc:
                    _note(
                        exc,
                        f"while learner {self.learner_id!r} was claiming or loading a unit in {describe(self.mailbox)}",
                    )
                    raise
                step, tensor, (identifier, token, kind, position) = item
                if kind == BATCH:
                    self._positions[identifier] = {"token": token, "step": step, "position": position}
                else:
                    self._positions.pop(identifier, None)
                if options is not None:
                    yield item
                elif kind == BATCH:
                    yield step, tensor
        finally:
            self._claim_stats.update(claimer.claim_stats)

    def _load_unit(self, identifier: str) -> Iterator[Batch]:
        try:
            batches = self.load(self.units[identifier])
        except Exception as exc:
            _note(exc, f"while loading unit {identifier!r}")
            raise
        try:
            iterator = iter(batches)
        except TypeError:
            raise LoaderError(
                f"load for unit {identifier!r} returned {_describe(batches)}, not an iterable "
                "of (step, batch) pairs; write load as a generator that yields them"
            ) from None
        try:
            while True:
                try:
                    item = next(iterator)
                except StopIteration:
                    return
                except Exception as exc:
                    _note(exc, f"while loading unit {identifier!r}")
                    raise
                yield _checked_batch(identifier, item)
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()


def _guarded(batches: Iterator[Batch], control: _Control, worker: int) -> Iterator[Batch]:
    """Run ``batches`` one step at a time under the worker's lock, until ``stop`` is set."""
    lock = control.locks[worker]
    try:
        while True:
            with lock:
                if control.stop.is_set():
                    return
                try:
                    item = next(batches)
                except StopIteration:
                    return
                except BaseException:
                    # This node is failing: the other workers stop claiming; batches already
                    # buffered, then this error, still reach the consumer in order.
                    control.stop.set()
                    raise
            yield item
    finally:
        with lock:
            batches.close()  # the loader's own cleanup, as part of the last operation


def _note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(note)


def _describe(value: object, limit: int = 120) -> str:
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ must not hide the real problem
        text = "<unrepresentable>"
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(value).__name__} {text}"


def _checked_batch(identifier: str, item: object) -> Batch:
    if isinstance(item, (tuple, list)) and len(item) == 2:
        step, batch = item
        if isinstance(step, numbers.Integral) and not isinstance(step, bool):
            if isinstance(batch, torch.Tensor):  # the common case: no walk
                return int(step), batch
            problem = first_non_tensor(batch)
            if problem is None:
                return int(step), batch
            raise LoaderError(
                f"load for unit {identifier!r} yielded a (step, batch) {type(item).__name__} at "
                f"step {int(step)} whose {problem}, not a torch.Tensor; a batch is a tensor, or "
                "tuples, lists and dicts of tensors (convert numbers and arrays with "
                "torch.as_tensor, keep other values out of the batch)"
            )
    raise LoaderError(
        f"load for unit {identifier!r} yielded {_describe(item)}; "
        "it must yield (step, batch) pairs: an int step and a torch.Tensor (or tuples, lists "
        "and dicts of tensors)"
    )


def _checked_order(order: Sequence[str] | None, units: Mapping[str, Any]) -> list[str]:
    if order is None:
        return list(units)
    if isinstance(order, (str, bytes)) or not isinstance(order, Iterable):
        raise ValueError(f"order must be a sequence of unit identifiers, not {type(order).__name__}")
    listed = list(order)
    strange = [entry for entry in listed if not isinstance(entry, str)]
    if strange:
        raise ValueError(f"order must hold unit identifiers (str), found {_describe(strange[0], 60)}")
    if len(listed) == len(units) and set(listed) == set(units):
        return listed
    counts = Counter(listed)
    repeated = [entry for entry, count in counts.items() if count > 1]
    unknown = [entry for entry in counts if entry not in units]
    missing = [identifier for identifier in units if identifier not in counts]
    problems = []
    for name, entries in (("missing", missing), ("unknown", unknown), ("repeated", repeated)):
        if entries:
            shown = ", ".join(repr(entry) for entry in entries[:3])
            more = f" and {len(entries) - 3} more" if len(entries) > 3 else ""
            problems.append(f"{name}: {shown}{more}")
    raise ValueError(
        "order must list every unit identifier exactly once (a permutation of the units' keys); " + "; ".join(problems)
    )


# -- shared_queue ------------------------------------------------------------------------------


def _keep(item: Batch) -> Batch:
    """DataLoader ``collate_fn`` that keeps each ``(step, batch)`` pair as it is, but lets
    small tensors travel to the training process inline (``gradientmail.patterns.inline``)."""
    if isinstance(item, tuple) and len(item) >= 2:
        return (item[0], inline(item[1]), *item[2:])  # type: ignore[return-value]
    return item


class _Batches(Iterator[Batch]):
    """The iterator ``shared_queue`` yields; ends for good after an error or after close."""

    on_end: Callable[[], None] | None = None
    """Called once when the batches run out (not after an error or ``close``)."""

    watch: BatchWatch | None = None
    """Times the loop's batches per unit (``unit_timing``) and strips their unit tags."""

    def __init__(self) -> None:
        self._finished = False

    def __iter__(self) -> _Batches:
        return self

    def __next__(self) -> Batch:
        if self._finished:
            raise StopIteration
        watch = self.watch
        if watch is not None:
            watch.ended()  # the loop asks for a batch: it has trained the previous one
        try:
            item = self._next()
            return item if watch is None else _watched(watch, item)
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
        raise NotImplementedError


def _watched(watch: BatchWatch, item: Any) -> Any:
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


def _log_claims(learner_id: str, worker: int | None, stats: Counter[str]) -> None:
    """One line per loader when it stops: what claiming cost (the conflicts summary)."""
    where = "" if worker is None else f" (worker {worker})"
    log.info(
        "%s%s: claimed %d units in %d attempts: %d conflicts, %d listings",
        learner_id,
        where,
        stats["claims"],
        stats["attempts"],
        stats["conflicts"],
        stats["listings"],
    )


_END = object()


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class _HandOff:
    """Calls ``next()`` on an iterator on a thread of its own, at most ``slots`` items ahead.

    Two uses. ``workers=0``: the iterator is the dataset's, so claiming and loading run on this
    thread, ahead of the loop. ``workers >= 1``: it is DataLoader's, whose ``next()`` unpickles
    each batch in the calling thread (receives the tensor's shared-memory file descriptor from
    the worker and maps it), about 1.5 ms per batch the loop would otherwise wait; this thread
    pays it during the training step. A place is reserved *before* each ``next()``, so the
    thread never holds an item that has none, and with the dataset's iterator a unit is claimed
    only when its first batch has a place. The end and an error queue up behind the items
    before them. Until ``finish`` returns True, no other thread may touch the iterator.
    """

    def __init__(self, iterator: Any, slots: int, name: str) -> None:
        self._iterator = iterator
        self._ready: deque[Any] = deque()
        self._room = slots
        self._stopping = False
        self._left = False  # the thread no longer touches the iterator
        self._then: Callable[[], None] | None = None  # cleanup the thread runs if abandoned
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                with self._changed:
                    self._changed.wait_for(lambda: self._stopping or self._room > 0)
                    if self._stopping:
                        return
                    self._room -= 1
                try:
                    item: Any = next(self._iterator)
                except StopIteration:
                    item = _END
                except BaseException as exc:  # delivered to the consumer, in order
                    item = _Failure(exc)
                with self._changed:
                    self._ready.append(item)
                    self._changed.notify_all()
                if item is _END or isinstance(item, _Failure):
                    return
        finally:
            with self._changed:
                self._left = True
                then = self._then
            if then is not None:
                then()

    def take(self) -> Batch:
        with self._changed:
            self._changed.wait_for(lambda: self._ready)
            item = self._ready.popleft()
            if item is not _END and not isinstance(item, _Failure):
                self._room += 1
                self._changed.notify_all()
        if item is _END:
            raise StopIteration
        if isinstance(item, _Failure):
            raise item.error
        return item

    def stop(self) -> None:
        """Take no more batches; a thread waiting for a free place leaves now."""
        with self._changed:
            self._stopping = True
            self._ready.clear()  # the consumer has left
            self._changed.notify_all()

    def finish(self, timeout: float | None, then: Callable[[], None], wake: Callable[[], None] | None = None) -> bool:
        """After ``stop``: wait up to ``timeout`` for the thread to leave the iterator; True when it has.

        If it is still inside ``next()`` then, ``wake`` (if given) tries to free it (DataLoader:
        ``_wake``); if it does not leave, it runs ``then`` itself when ``next()`` returns.
        """
        self._thread.join(timeout)
        if self._thread.is_alive() and wake is not None:
            wake()
            self._thread.join(_utils.MP_STATUS_CHECK_INTERVAL)
        with self._changed:
            if not self._left:
                self._then = then
                return False
        self._thread.join()  # only its last few lines are left
        return True


def _wake(iterator: Any) -> None:
    """Make a thread blocked in the DataLoader iterator's ``next()`` raise (``idx, data = None``)."""
    data_queue = getattr(iterator, "_data_queue", None)
    if data_queue is not None:
        data_queue.put(None)


class _ThreadBatches(_Batches):
    """``workers=0``: claims and loads on one background thread, ``prefetch`` batches ahead."""

    def __init__(self, dataset: SharedQueueDataset[Any], prefetch: int, timeout: float | None) -> None:
        super().__init__()
        self._timeout = timeout
        self._gauge = dataset._gauge
        self._source = iter(dataset)
        # A daemon: never keeps the interpreter alive; close() joins it.
        self._pump = _HandOff(self._source, prefetch, f"gradientmail-shared-queue-{dataset.learner_id}")

    def _next(self) -> Batch:
        batch = self._pump.take()
        if self._gauge is not None:
            self._gauge.consumed()
        return batch

    def close(self) -> None:
        self._finished = True
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


class _ElasticBatches(_Batches):
    """Strips the elastic tags and tells the ``ProgressTracker`` what the loop consumed."""

    def __init__(self, inner: _Batches, tracker: ProgressTracker, halt: list[bool]) -> None:
        super().__init__()
        self._inner = inner
        self._tracker = tracker
        self._consumption = Consumption(tracker)
        self._halt = halt
        self._closed = False

    def _next(self) -> Batch:
        return self._consumption.next_from(self._inner)

    def close(self, consumed_last: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        self._finished = True
        self._halt[0] = True  # a claimer waiting for orphans stops waiting
        try:
            self._inner.close()
        finally:
            self._consumption.finish(consumed_last=consumed_last)
            self._tracker.close()


class _LoaderBatches(_Batches):
    """``workers >= 1``: a DataLoader whose workers claim and load, ``prefetch`` batches in all.

    DataLoader buffers ``prefetch_factor`` batches per worker, so ``prefetch`` rounds down to a
    multiple of ``workers``; of those, each worker's last place is moved to a ``_HandOff`` that
    takes batches off the training thread (none when ``prefetch < 2 * workers``).
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
        self._control = _Control(context, workers)
        dataset = copy.copy(dataset)  # the caller's dataset stays usable on its own
        dataset._control = self._control
        dataset._verified = True
        self._gauge = dataset._gauge
        # prefetch_factor is per worker: the total in flight stays <= prefetch. A worker with
        # two places or more gives its last one to the hand-off (the total is unchanged).
        per_worker = prefetch // workers
        slots = workers if per_worker > 1 else 0
        options: dict[str, Any] = {
            "batch_size": None,
            "num_workers": workers,
            "prefetch_factor": per_worker - 1 if slots else per_worker,
            "collate_fn": _keep,
            "persistent_workers": False,
            "pin_memory": pin_memory,
            "multiprocessing_context": context,
        }
        if _HAS_IN_ORDER:
            # Hand out each batch as soon as any worker has it: with DataLoader's default
            # round-robin a fast worker would wait for a slow one.
            options["in_order"] = False
        self._iterator: Any = iter(DataLoader(dataset, **options))
        self._pump: _HandOff | None = None
        if slots:
            self._pump = _HandOff(self._iterator, slots, f"gradientmail-handoff-{dataset.learner_id}")

    def _next(self) -> Batch:
        if self._iterator is None:
            raise StopIteration
        batch = next(self._iterator) if self._pump is None else self._pump.take()
        if self._gauge is not None:
            self._gauge.consumed()
        return batch

    def close(self) -> None:
        self._finished = True
        iterator, self._iterator = self._iterator, None
        if iterator is None:
            return
        pump, self._pump = self._pump, None
        self._control.stop.set()
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
        if pump is not None and not pump.finish(remaining, shut_down, functools.partial(_wake, iterator)):
            warnings.warn(
                "shared_queue: the hand-off thread is still waiting for a worker; it shuts the "
                "DataLoader down when that returns",
                stacklevel=2,
            )
            return
        shut_down()


def _shut_down(iterator: Any) -> None:
    # DataLoader's own shutdown only has to collect the workers (it would SIGTERM one still
    # busy after 5 s).
    iterator._shutdown_workers()
    for queue in [*getattr(iterator, "_index_queues", ()), getattr(iterator, "_worker_result_queue", None)]:
        feeder = getattr(queue, "_thread", None)
        if feeder is not None:
            queue.close()  # done by the shutdown, except for the result queue _wake put into
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


def _context(value: Any) -> multiprocessing.context.BaseContext:
    if value is None or isinstance(value, str):
        return multiprocessing.get_context(value)
    if isinstance(value, multiprocessing.context.BaseContext):
        return value
    raise TypeError(f"multiprocessing_context must be None, a start method name or a context, not {value!r}")


def _check_for_workers(dataset: SharedQueueDataset[Any], context: multiprocessing.context.BaseContext) -> None:
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


def _positive(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, not {value}")
    return value


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
        if dataset._counter.total() == 0:  # claims of this queue, its worker processes included
            warnings.warn(
                f"shared_queue: 0 batches for learner {dataset.learner_id!r}: every unit of this "
                f"run ({len(dataset.units)} units in {describe(dataset.mailbox)}) is already taken "
                "or done; use a fresh prefix to train again",
                stacklevel=3,  # the training loop's line
            )

    return check


WITH_HINT = (
    "shared_queue(...) is a context manager, not an iterable: write "
    "`with shared_queue(...) as batches:` and iterate `batches` inside the block (leaving it "
    "stops the loaders cleanly)"
)

T = TypeVar("T")
P = ParamSpec("P")


class QueueContext(contextlib.AbstractContextManager, Generic[T]):
    """What ``shared_queue(...)`` returns: a context manager that says so when iterated."""

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
    learner_id: str,
    load: Callable[[V], Iterable[tuple[int, TensorTree]]],
    prefetch: int = 8,
    workers: int = 1,
    order: Sequence[str] | None = None,
    pin_memory: bool = False,
    multiprocessing_context: str | multiprocessing.context.BaseContext | None = None,
    shutdown_timeout: timedelta | float | None = None,
    resume: bool = False,
    lease: timedelta | float | None = None,
    claim_ahead: int = DEFAULT_CLAIM_AHEAD,
    progress: bool = False,
) -> Iterator[Iterator[Batch]]:
    """Consume a shared queue of work units: ``with shared_queue(...) as batches:``.

    Yields an iterator of ``(step, batch)``, each batch as ``load`` made it (a tensor, or
    tuples, lists and dicts of tensors; ``gradientmail.patterns.batches.to_device`` moves one
    to the GPU). Claiming and loading run ahead of the training loop in ``workers`` DataLoader
    worker processes (``workers=0``: one thread in this process, for notebooks, a
    ``MemoryMailbox`` or a loader that cannot be pickled). With
    ``prefetch >= 2 * workers`` a thread of this process takes each batch from the workers, so
    the loop does not wait for DataLoader's hand-over (about 1.5 ms a batch).

    A prefix holds one run of one unit set: a node whose units differ from the run's is refused
    (``RunMismatchError``, ``gradientmail.run_record``), and a node that gets no batch because
    every unit is already taken or done warns once. Iterating ``shared_queue(...)`` itself,
    without ``with``, raises a ``TypeError`` that says so.

    Guarantees:
        - At most ``prefetch`` batches are buffered in all (so ``prefetch >= workers``); a
          unit is claimed only while the buffer has room (the loop asked for a batch), never
          while it is full; claims ahead (``claim_ahead``) start only then, but may complete,
          or retry after a conflict, while it is full.
        - Every unit is loaded by exactly one claimer of all nodes and workers (the claim
          protocol in ``gradientmail.patterns.claims``); a node that finds no unclaimed unit
          delivers what it buffered and stops.
        - An error from ``load`` or the mailbox reaches the loop after the batches buffered
          before it, with its type (and, from a worker process, its original message and
          traceback) visible; the iterator then ends.
        - Leaving the block, normally, by ``break`` or by an exception, stops prefetching, waits
          for the loader or mailbox operation in flight (up to ``shutdown_timeout``, default
          unbounded), and leaves no worker process or thread behind.
        - Step order: each unit's batches arrive in its step order. With ``workers > 1`` units
          loaded by different workers interleave (whichever batch is ready first), so steps are
          not globally sorted; use ``step`` as a label (learning-rate schedule), not a counter.
        - One process per learner: entering the block while another live process runs the same
          ``learner_id`` in this mailbox raises ``DuplicateLearnerError`` before anything is
          claimed; a restart after a crash is allowed (``gradientmail.patterns.presence``).

    Args:
        units, mailbox, learner_id, load, order: as for ``SharedQueueDataset``.
        prefetch: Batches buffered ahead of the loop, in all.
        workers: DataLoader worker processes; 0 runs on a thread in this process.
        pin_memory: Passed to the DataLoader (page-locked batches, every tensor of a
            structured one, for faster GPU copies; needs ``workers >= 1``).
        multiprocessing_context: Start method for workers (default: Python's default).
        claim_ahead: Most claims each loader keeps in flight ahead of the one it is loading,
            so that a slow store's round trips overlap loading (default 64, a cap; 0: on
            demand, as the seed). From the second wait for a claim in a row during which the
            loop ran dry or the buffer was under half full, the depth is set to the measured
            claim time over the measured unit time, plus one, and never ties more than
            ``claim_ahead.TIED_S`` (1 s) of loading to the node; a loop slower than its
            loader, or one that stopped taking batches, never triggers it. Units claimed ahead
            are lost to the run if the block is left early.
        shutdown_timeout: Longest wait for an operation in flight when leaving the block.
        resume: Record progress, release unfinished units when leaving the block, and take
            back this learner's (and released) units first when restarted; see
            ``gradientmail.patterns.elastic``. Needs a store with ``replace_if``.
        lease: A ``timedelta``: renew a heartbeat while batches are consumed and take over the
            units of nodes whose heartbeat stopped for that long. Needs ``replace_if``.
        progress: Show the run's units taken and this node's batches/s on stderr: a rich bar
            on a terminal (``MissingExtraError`` without the ``cli`` extra), else a plain line
            every 10 s. Reads counters and lists ``units/`` at most every 5 s, on its own
            thread, which leaving the block stops (``gradientmail.patterns.progress_display``).

    Logs to ``logging.getLogger("gradientmail.queue")``: the start and end of the block at INFO,
    each unit claimed and loaded at DEBUG. Each batch's unit is timed (its first batch's start
    to its last one's end), and a ``Session`` of this learner writes the recent spans into its
    progress record for ``gradientmail plot`` (``gradientmail.patterns.unit_timing``).

    With ``resume`` or ``lease`` a batch counts as consumed when the loop asks for the next one,
    or when the block is left without an exception; units are then recorded as done, and
    batches consumed by a node that dies after its last progress write are redone by the node
    that takes its unit over (at-least-once for those, exactly-once for the rest).
    """
    prefetch = _positive("prefetch", prefetch, 1)
    workers = _positive("workers", workers, 0)
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
        context = _context(multiprocessing_context)
        _check_for_workers(dataset, context)
    if not dataset.units:
        yield iter(())
        return
    prepare_mailbox(mailbox, len(dataset.units), dataset.units)
    dataset._verified = True
    if dataset._elastic is not None:
        # One incarnation for this node's workers, its tracker and its presence record.
        dataset._elastic = ElasticOptions(resume, dataset.lease_s)
    incarnation = dataset._elastic.incarnation if dataset._elastic is not None else uuid.uuid4().hex
    presence = Presence(mailbox, dataset.learner_id, incarnation, renew_s=presence_renew_s(dataset.lease_s))
    presence.start()  # DuplicateLearnerError before anything is claimed or recorded
    watch = BatchWatch(unit_times(describe(mailbox), dataset.learner_id))
    dataset._timed = True
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
            dataset.claim_ahead if dataset._elastic is None else 0,
        )
        if dataset._elastic is None:
            dataset._gauge = BufferGauge(max(1, workers), prefetch)
        tracker: ProgressTracker | None = None
        if dataset._elastic is not None:
            # The lease exists before the first claim.
            dataset._tagged = True
            tracker = ProgressTracker(mailbox, dataset.learner_id, dataset._elastic)
            tracker.start()
        batches: _Batches
        if workers == 0:
            batches = _ThreadBatches(dataset, prefetch, timeout)
        else:
            assert context is not None
            batches = _LoaderBatches(
                dataset,
                prefetch=prefetch,
                workers=workers,
                context=context,
                pin_memory=pin_memory,
                timeout=timeout,
            )
        batches.watch = watch
        if tracker is None:
            try:
                batches.on_end = _warn_if_nothing_claimed(dataset)
                yield batches
            finally:
                watch.ended()  # the last batch's training ends here, not after the shutdown
                batches.close()
            return
        elastic = _ElasticBatches(batches, tracker, dataset._halt)
        clean = False
        try:
            elastic.on_end = _warn_if_nothing_claimed(dataset)
            yield elastic
            clean = True
        finally:
            watch.ended()
            if clean:
                elastic.close(consumed_last=True)
            else:
                try:
                    elastic.close(consumed_last=False)
                except Exception as exc:  # do not hide the error that is leaving the block
                    warnings.warn(f"shared_queue: recording progress on exit failed: {exc!r}", stacklevel=3)
    finally:
        if display is not None:
            display.close()
        conflicts = dataset._claim_stats["conflicts"]  # workers count their own (logged there)
        log.info(
            "%s: left the shared queue after %.1fs: %d batches of %d units trained, %d units claimed by this learner%s",
            dataset.learner_id,
            time.monotonic() - began,
            watch.batches,
            watch.units,
            dataset._counter.total(),
            f", {conflicts} conflicts" if workers == 0 else "",
        )
        presence.close()


def _mode(dataset: SharedQueueDataset[Any]) -> str:
    if dataset._elastic is None:
        return "seed queue"
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
        mine=dataset._counter.total,
        batches=lambda: watch.batches,
        run_taken=run_taken,
    )
    display.start()
    return display
