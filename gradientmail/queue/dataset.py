"""``SharedQueueDataset``: an ``IterableDataset`` that claims work units and loads their batches.

The long story (how claiming, resuming and worker processes interact) is in ``docs/queue.md``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, Generic, TypeVar

from torch.utils.data import IterableDataset, get_worker_info

from gradientmail.learner_id import default_learner_id
from gradientmail.mailbox.base import Mailbox, describe, require_replace_if
from gradientmail.meeting_point import meeting_point
from gradientmail.presence import QUEUE, PresenceShare, presence_renew_s
from gradientmail.queue.batch_checks import (
    Batch,
    Item,
    UnitTag,
    add_note,
    checked_count,
    checked_order,
    describe_value,
    loaded_batches,
)
from gradientmail.queue.batches import TensorTree
from gradientmail.queue.claim_ahead import ClaimAhead
from gradientmail.queue.claim_counter import ClaimCounter, register_counter
from gradientmail.queue.claim_index import ClaimIndex, PositionOrder
from gradientmail.queue.claimer import DEFAULT_LISTING, LISTING_POLICIES, Claimer
from gradientmail.queue.claims import validate_identifiers, validate_learner_id
from gradientmail.queue.crowd import CROWD_LIMIT, SHARED_CROWD_LIMIT
from gradientmail.queue.elastic_options import ElasticOptions, check_elastic, elastic_options
from gradientmail.queue.figures import queue_figures
from gradientmail.queue.group import LeaderLoad, Split, follower_batches, leader_batches, split_rows, tagged_units
from gradientmail.queue.loading_marks import LoadingMarks
from gradientmail.queue.pacing import BufferGauge, Endgame, UnitPacer
from gradientmail.queue.progress import ProgressTracker, consume_inline, tagged_items
from gradientmail.queue.reclaim import ElasticClaimer
from gradientmail.queue.unfinished import untracked_record, warn_unfinished
from gradientmail.queue.worker_control import WorkerControl, exit_with_parent, guarded
from gradientmail.run_record import prepare_mailbox
from gradientmail.session.group import GroupSync

__all__ = ["SharedQueueDataset"]


V = TypeVar("V")

log = logging.getLogger("gradientmail.queue")


@dataclasses.dataclass(frozen=True)
class Wiring:
    """How ``shared_queue`` runs a ``SharedQueueDataset``: one immutable set of options, given at
    construction and replaced whole by ``configured`` (a dataset used on its own keeps the defaults).

    Attributes:
        prepared: ``prepare_mailbox`` already ran (in the main process, once).
        gauge: The loop's buffer and pace: loaders claim just in time for it (``queue.pacing``)
            and claim ahead when it starves.
        control: Stops DataLoader workers between operations.
        tagged: Yield elastic items tagged for a ``ProgressTracker`` in the consumer.
        timed: Batches travel as ``Item``s that name their unit (for ``unit_timing``), not pairs.
        elastic: The resume/lease options its workers take (None: the design note's queue).
    """

    prepared: bool = False
    gauge: BufferGauge | None = None
    control: WorkerControl | None = None
    tagged: bool = False
    timed: bool = False
    elastic: ElasticOptions | None = None


class SharedQueueDataset(IterableDataset[Batch], Generic[V]):
    """Claims work units from a shared mailbox and yields each claimed unit's batches.

    Iterating claims the first unclaimed unit in ``order``, yields its ``(step, batch)`` pairs,
    then claims the next, until none is left; every DataLoader worker claims for itself.

    Args:
        units: Identifier → unit value, the same on every node (identifiers are key segments).
        mailbox: The mailbox every node shares.
        learner_id: This process's name in the run; default ``default_learner_id()`` (host
            name + launcher rank: unique across machines, the same when the process restarts).
        load: ``load(value)`` yields ``(step, batch)`` pairs for one unit, in step order; a
            batch is a tensor, or tuples, lists and dicts of tensors.
        order: This node's preference, a permutation of the identifiers (default: theirs).
        resume: None (automatic, the default): where the store has ``replace_if`` and the loop's
            consumption can be seen (``shared_queue``, or this dataset iterated in the training
            process), record what the loop consumed, so a learner restarted under the same id
            takes its unfinished units back at the exact batch; elsewhere (a DataLoader worker)
            the design note's queue, which warns about units an earlier run of this learner left
            unfinished. True: also release unfinished units to any node on a clean exit (needs
            ``replace_if``). False: the design note's queue.
        lease: Renew a heartbeat and take over units of nodes silent for ``lease``.
        claim_ahead: Most units claimed ahead of the one being loaded (0: on demand).
        listing: When the claimer lists claims (``claims.LISTING_POLICIES``).
        claim_index: A ``ClaimIndex`` of these units to share; None builds one on first use.
        prepared: ``prepare_mailbox`` already ran for these units; iterating skips it.
        group: A ``torch.distributed`` process group whose ranks train one model in lockstep
            (DDP): one learner of the queue, as with ``shared_queue(group=)``. Its rank 0
            claims, every rank gets its share of every batch and they all end at the same step.
            Iterate it in the training process (``DataLoader(dataset, batch_size=None,
            num_workers=0)``): its ranks agree on each batch with the group's collectives, which
            DataLoader worker processes cannot join (``shared_queue(group=, workers=N)`` loads
            rank 0's units in worker processes and announces them from the training process).
        split: ``split(batch, rank, size)``, a rank's share of a whole batch (with ``group``).

    Example:
        >>> import torch
        >>> from gradientmail.mailbox import MemoryMailbox
        >>> load = lambda n: ((step, torch.tensor([n])) for step in range(2))
        >>> box = MemoryMailbox("doctest-dataset")
        >>> dataset = SharedQueueDataset({"a": 1, "b": 2}, mailbox=box, learner_id="n0", load=load)
        >>> [(step, int(batch)) for step, batch in dataset]
        [(0, 1), (1, 1), (0, 2), (1, 2)]
    """

    def __init__(
        self,
        units: Mapping[str, V],
        *,
        mailbox: Mailbox,
        learner_id: str | None = None,
        load: Callable[[V], Iterable[tuple[int, TensorTree]]],
        order: Sequence[str] | None = None,
        resume: bool | None = None,
        lease: timedelta | float | None = None,
        claim_ahead: int = 0,
        listing: str = DEFAULT_LISTING,
        claim_index: ClaimIndex | None = None,
        prepared: bool = False,
        group: Any = None,
        split: Split | None = split_rows,
    ) -> None:
        super().__init__()
        self.group_sync = None if group is None else GroupSync(group)
        """The group's collectives (``group=``); not pickled: a process group is its process's own."""
        self.grouped = group is not None
        """Iterated as one rank of a group (a worker process, which has no ``group_sync``, refuses)."""
        self._split = split
        if listing not in LISTING_POLICIES:
            raise ValueError(f"listing must be one of {LISTING_POLICIES}, not {listing!r}")
        if not isinstance(units, Mapping):
            raise TypeError(f"units must be a mapping of identifier -> unit value, not {type(units).__name__}")
        self.units: dict[str, V] = dict(units)
        validate_identifiers(self.units)
        self.learner_id = validate_learner_id(default_learner_id() if learner_id is None else learner_id)
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
        self.order: Sequence[str] = checked_order(order, self.units)
        # Every node without an order walks the mapping's: they crowd the same next units.
        self._crowd_limit = SHARED_CROWD_LIMIT if order is None else CROWD_LIMIT
        self.claim_ahead = checked_count("claim_ahead", claim_ahead, 0)
        self._counter = self._meet(mailbox, self.learner_id)
        self._listing = listing
        self._claim_index: ClaimIndex | None = claim_index  # built on first use unless shared
        self._claim_stats: Counter[str] = Counter()  # per process, shared by configured copies
        self.lease_s = check_elastic(mailbox, resume, lease)
        self.wiring = Wiring(prepared=prepared, elastic=elastic_options(mailbox, resume, self.lease_s))
        """How ``shared_queue`` runs this dataset (``configured`` returns a copy wired otherwise)."""
        self.resume = self.wiring.elastic is not None and self.wiring.elastic.resume
        """Whether a restarted learner takes its own unfinished units back (``resume`` resolved)."""
        self.marks_loading = resume is None
        """The design note's queue chosen by the automatic mode (a DataLoader worker, a store
        without ``replace_if``) marks each unit it loads in ``work/`` (a PUT and a DELETE per
        unit), so that ``status`` and a restart see what it left; ``resume=False`` records nothing."""
        self.incarnation = uuid.uuid4().hex
        """This dataset's run of the learner in the design note's queue (its workers share it):
        ``work/`` records of another one are units an earlier run left unfinished."""
        self._halt = [False]  # set when the consumer leaves (workers=0 has no control)
        self._restore: dict[str, dict[str, Any]] = {}
        self._positions: dict[str, dict[str, Any]] = {}  # unit -> token, last step yielded

    def __repr__(self) -> str:
        return (
            f"SharedQueueDataset({len(self.units)} units, learner_id={self.learner_id!r}, "
            f"mailbox={describe(self.mailbox)})"
        )

    # -- what shared_queue configures and reads ------------------------------------------------
    def configured(
        self,
        *,
        prepared: bool | None = None,
        gauge: BufferGauge | None = None,
        control: WorkerControl | None = None,
        tagged: bool | None = None,
        timed: bool | None = None,
        elastic: ElasticOptions | None = None,
    ) -> SharedQueueDataset[V]:
        """A copy wired the way ``shared_queue`` runs it: this dataset's ``Wiring`` with the
        given fields replaced (None: as in this dataset).

        The copy shares this dataset's claim counter, claim statistics and ``stop_claiming``.
        """
        changes = {
            "prepared": prepared,
            "gauge": gauge,
            "control": control,
            "tagged": tagged,
            "timed": timed,
            "elastic": elastic,
        }
        dataset = copy.copy(self)
        dataset.wiring = dataclasses.replace(self.wiring, **{k: v for k, v in changes.items() if v is not None})
        return dataset

    def for_node(self, *, mailbox: Mailbox, learner_id: str, order: PositionOrder) -> SharedQueueDataset[V]:
        """A copy that claims as another node of this run: its own mailbox client, learner id and
        preference order (positions in this dataset's shared ``claim_index``).

        The copy shares the units, claim index and claim statistics: the queue simulator runs a
        thousand nodes in one process without building and checking the units once per node. Its
        claims count as ``learner_id``'s on its mailbox's store (``units_claimed_by``, the
        learner's meeting point), never as this dataset's learner's.

        Raises:
            ValueError: ``order`` holds positions of another claim index than this dataset's.
        """
        if order.index is not self._claim_index:
            raise ValueError("order must hold positions in this dataset's claim_index (give it claim_index=)")
        learner_id = validate_learner_id(learner_id)
        dataset = copy.copy(self)
        # vars(): the copy's own counter is a private field, set where this class is written.
        vars(dataset).update(
            mailbox=mailbox, learner_id=learner_id, order=order, _counter=self._meet(mailbox, learner_id)
        )
        return dataset

    @staticmethod
    def _meet(mailbox: Mailbox, learner_id: str) -> ClaimCounter:
        """A new claim counter of ``learner_id`` on ``mailbox``'s store, reported at their
        meeting point (what the learner's Session shows as the units it claimed)."""
        point = meeting_point(mailbox, learner_id)
        counter = register_counter(learner_id, point.store)
        point.report_figures(queue_figures(point))
        return counter

    @property
    def elastic(self) -> ElasticOptions | None:
        """The resume/lease options (one incarnation per dataset); None for the design note's queue."""
        return self.wiring.elastic

    @property
    def gauge(self) -> BufferGauge | None:
        """The consumer's buffer gauge set by ``configured``, if any."""
        return self.wiring.gauge

    @property
    def claim_stats(self) -> Counter[str]:
        """A copy of the claimers' statistics in this process (claims, attempts, conflicts, listings)."""
        return Counter(self._claim_stats)

    def units_claimed(self) -> int:
        """Units claimed through this dataset (and its configured copies), workers included."""
        return self._counter.total()

    def stop_claiming(self) -> None:
        """Tell a claimer in this process that waits for orphaned units to stop waiting."""
        self._halt[0] = True

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["group_sync"] = None  # a process group does not travel: a worker refuses to iterate
        return state

    def __iter__(self) -> Iterator[Batch | Item]:
        if self.grouped:
            return self._group_batches()
        info = get_worker_info()
        worker = info.id if info is not None else None
        if worker is not None:
            exit_with_parent()
        if not self.units:
            return iter(())
        if self.wiring.elastic is not None and not self.wiring.tagged:
            if worker is not None and self.wiring.elastic.automatic and self.wiring.elastic.lease_s is None:
                # The automatic mode cannot see the loop from here: the design note's queue.
                batches = self._claim_and_load(worker, None)
                if self.wiring.control is None:
                    return batches
                return guarded(batches, self.wiring.control, worker)
            if worker is not None:
                raise ValueError(
                    "resume= and lease= record what the training loop consumed, which a "
                    "DataLoader worker cannot see: use shared_queue(...), iterate the dataset "
                    "in the training process, or use state_dict()/load_state_dict() (e.g. "
                    "torchdata's StatefulDataLoader) without these options"
                )
            if not self.wiring.prepared:  # a store that cannot create atomically is refused first
                prepare_mailbox(self.mailbox, len(self.units), self.units)
                return self.configured(prepared=True).__iter__()
            joined = meeting_point(self.mailbox, self.learner_id).gate.take_join_marks()
            options = dataclasses.replace(self.wiring.elastic, incarnation=uuid.uuid4().hex, joined_marks=joined)
            tracker = ProgressTracker(self.mailbox, self.learner_id, options)
            presence = PresenceShare(
                self.mailbox,
                self.learner_id,
                QUEUE,
                incarnation=options.incarnation,
                renew_s=presence_renew_s(options.lease_s),
            )
            return consume_inline(self._claim_and_load(None, options), tracker, presence)
        batches = self._claim_and_load(worker, self.wiring.elastic)
        if self.wiring.control is None:
            return batches
        return guarded(batches, self.wiring.control, worker or 0)

    def _group_batches(self) -> Iterator[Batch]:
        """This rank's share of each step: rank 0 claims through a copy of this dataset over
        tagged units and announces each batch; the other ranks load what it announces."""
        sync = self.group_sync
        if sync is None or get_worker_info() is not None:
            raise ValueError(
                "a SharedQueueDataset with group= must be iterated in the training process "
                "(DataLoader(dataset, batch_size=None, num_workers=0)): its ranks agree on every batch "
                "through the group's collectives, which DataLoader worker processes cannot join; "
                "shared_queue(..., group=group, workers=N) loads rank 0's units in worker processes"
            )
        if not sync.leads:
            return follower_batches(self.units, self.load, self._split, sync)
        leader = copy.copy(self)
        leader.grouped, leader.group_sync = False, None
        leader.units = tagged_units(self.units)  # type: ignore[assignment]
        load = LeaderLoad(self.load, self._split, sync.size)
        leader.load = load  # type: ignore[assignment]
        return leader_batches(leader, sync, load.started)

    # -- torchdata's Stateful protocol ---------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Per unit being read: its claim token, last step handed out and position in ``load``.

        In a DataLoader worker this is that worker's state.
        """
        return {
            "version": 1,
            "learner_id": self.learner_id,
            "units": {identifier: dict(position) for identifier, position in self._positions.items()},
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Take the units of ``state_dict`` back on the next iteration, continuing each after its
        last position (a compare-and-swap on the claim: needs ``replace_if``)."""
        units = state_dict.get("units") if isinstance(state_dict, Mapping) else None
        if not isinstance(units, Mapping):
            raise ValueError(f"not a SharedQueueDataset state_dict (no 'units' mapping): {describe_value(state_dict)}")
        if state_dict.get("learner_id") not in (None, self.learner_id):
            raise ValueError(
                f"state_dict of learner {state_dict.get('learner_id')!r} loaded into learner {self.learner_id!r}"
            )
        restore = {str(i): dict(p) for i, p in units.items() if i in self.units and isinstance(p, Mapping)}
        if restore:
            require_replace_if(self.mailbox, "load_state_dict")
        self._restore = restore

    def _claim_and_load(self, worker: int | None, options: ElasticOptions | None = None) -> Iterator[Batch | Item]:
        if not self.units:
            return
        if not self.wiring.prepared:
            prepare_mailbox(self.mailbox, len(self.units), self.units)
        if options is not None or self._restore:
            yield from self._claim_and_load_elastic(worker, options)
            return
        marks = None
        if self.marks_loading:
            if worker in (None, 0) and not self.wiring.prepared:  # shared_queue warns in its own process
                warn_unfinished(self.mailbox, self.learner_id, self.incarnation)
            marks = LoadingMarks(self.mailbox, self.learner_id, untracked_record(self.learner_id, self.incarnation))
        if self._claim_index is None:
            self._claim_index = ClaimIndex(self.units)
        claimer = Claimer(
            self.mailbox,
            self.order,
            self.learner_id,
            worker=worker,
            listing=self._listing,
            index=self._claim_index,
            crowd_limit=self._crowd_limit,
        )
        gauge = self.wiring.gauge
        pacer = (
            None if gauge is None else UnitPacer(gauge, worker, Endgame(claimer.unclaimed, self.mailbox, gauge.holds))
        )
        claims = ClaimAhead(
            claimer,
            limit=self.claim_ahead,
            gauge=gauge,
            count=lambda: self._counter.add(worker),
            name=f"gradientmail-claim-{self.learner_id}",
        )
        try:
            while True:
                if pacer is not None and not pacer.wait():
                    return  # the loop has left: claim nothing more
                try:
                    identifier = claims.next()
                except Exception as exc:
                    add_note(exc, f"while learner {self.learner_id!r} was claiming a unit in {describe(self.mailbox)}")
                    raise
                if identifier is None:
                    return
                if marks is not None:  # claimed and not yet loaded: what ``status`` and a restart see
                    marks.loading(identifier)
                for position, (step, tensor) in enumerate(self._load_unit(identifier)):
                    self._positions[identifier] = {"token": None, "step": step, "position": position}
                    if pacer is not None:
                        pacer.produced()
                    yield Item(step, tensor, UnitTag(identifier)) if self.wiring.timed else (step, tensor)
                if pacer is not None:
                    pacer.ended()  # a unit without batches
                if marks is not None:
                    marks.loaded(identifier)
                loaded = self._positions.pop(identifier, None)
                if log.isEnabledFor(logging.DEBUG):
                    batches = 0 if loaded is None else loaded["position"] + 1
                    log.debug("%s loaded unit %s (%d batches)", self.learner_id, identifier, batches)
        finally:
            if pacer is not None:
                pacer.ended()
            claims.close()
            if marks is not None:
                marks.close()
            self._claim_stats.update(claimer.stats)
            _log_claims(self.learner_id, worker, claimer.stats)

    def _claim_and_load_elastic(self, worker: int | None, options: ElasticOptions | None) -> Iterator[Batch | Item]:
        """Resume, leases or a restored state: ``ElasticClaimer`` picks the units; with
        ``options`` the items stay tagged for the consumer's ``ProgressTracker``."""
        control = self.wiring.control
        halt = self._halt
        claimer = ElasticClaimer(
            self.mailbox,
            self.order,
            self.learner_id,
            options or ElasticOptions(resume=False, lease_s=None),
            worker=worker,
            listing=self._listing,
            crowd_limit=self._crowd_limit,
            restore=self._restore,
            stopping=lambda: halt[0] or (control is not None and control.stop.is_set()),
            claim_ahead=self.claim_ahead,
            gauge=self.wiring.gauge,
        )
        self._restore = {}
        gauge = self.wiring.gauge
        pacer = (
            None if gauge is None else UnitPacer(gauge, worker, Endgame(claimer.unclaimed, self.mailbox, gauge.holds))
        )
        try:
            items = tagged_items(
                claimer, self._load_unit, lambda: self._counter.add(worker), None if pacer is None else pacer.wait
            )
            while True:
                try:
                    item = next(items)
                except StopIteration:
                    return
                except Exception as exc:
                    add_note(
                        exc,
                        f"while learner {self.learner_id!r} was claiming or loading a unit in {describe(self.mailbox)}",
                    )
                    raise
                step, tag = item.step, item.tag
                if tag.ended is not None:
                    self._positions.pop(tag.ended[0], None)
                if tag.end:
                    self._positions.pop(tag.unit, None)
                else:
                    self._positions[tag.unit] = {"token": tag.token, "step": step, "position": tag.position}
                if options is not None:
                    if pacer is not None:
                        pacer.produced()  # a lone end marker too: it takes a place in the buffer
                    yield item  # for the consuming side's ProgressTracker
                elif not tag.end:
                    if pacer is not None:
                        pacer.produced()
                    yield item._replace(tag=UnitTag(tag.unit)) if self.wiring.timed else item.pair
        finally:
            if pacer is not None:
                pacer.ended()
            claimer.close()
            self._claim_stats.update(claimer.claim_stats)

    def _load_unit(self, identifier: str) -> Iterator[Batch]:
        return loaded_batches(self.load, self.units[identifier], identifier)


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
