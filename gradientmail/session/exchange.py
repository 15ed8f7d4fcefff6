"""The background side of a ``Session``: one worker thread that joins, folds progress and leaves.

The training thread (``session.core``) hands jobs to a ``Worker`` and applies their results at a
step boundary; everything that touches the mailbox runs here. Data flows one way: ``core``
imports this module, never the reverse.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gradientmail.errors import GradientMailError, SessionError
from gradientmail.fold_gate import UnitMark
from gradientmail.layout import member_key, progress_key
from gradientmail.mailbox.base import Mailbox, describe
from gradientmail.meeting_point import meeting_point
from gradientmail.records import MemberRecord, ProgressRecord
from gradientmail.session.chain import ABSORB, FragmentChain, View
from gradientmail.session.fragments import Fragment, FragmentPlan, Piece, widen
from gradientmail.session.mail import Contribution, State, all_finite
from gradientmail.session.marks_store import MarksRef, lines_marks
from gradientmail.session.members import Members, SignsOfLife, check_prefix, list_members
from gradientmail.session.outer import OuterOptimizer, OuterState
from gradientmail.session.overlap import parallel


class Job:
    """One unit of background work; the training thread polls ``done`` (an ``Event``).

    A failure is recorded in ``error`` and raised later on the training thread, never here.
    """

    __slots__ = ("fn", "done", "result", "error")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # recorded here, raised on the training thread
            self.error = exc
        finally:
            self.fn = None
            self.done.set()


class Worker:
    """The one background thread of a session; runs jobs one at a time, in order.

    Example:
        >>> worker = Worker("example")
        >>> job = worker.submit(lambda: 6 * 7)
        >>> job.done.wait(5), job.result
        (True, 42)
        >>> worker.close(5)
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        # Daemon: a store that never answers must not keep the interpreter alive at exit; every
        # wait on this thread is bounded by the session's timeout instead.
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            job.run()

    def submit(self, fn: Callable[[], Any]) -> Job:
        """Queue ``fn``; its ``Job`` says when it is done and what it returned or raised."""
        job = Job(fn)
        self._jobs.put(job)
        return job

    def close(self, timeout: float) -> None:
        """Stop after the queued jobs; wait at most ``timeout`` seconds for the thread."""
        self._jobs.put(None)
        self._thread.join(timeout)


def surface(error: BaseException, what: str) -> BaseException:
    """The exception to raise on the training thread for a background ``error`` of ``what``.

    ``GradientMailError``s are raised as themselves (with a note saying where), anything else
    wrapped in ``SessionError``.
    """
    where = f"raised by {what}"
    if isinstance(error, GradientMailError):
        if hasattr(error, "add_note") and where not in getattr(error, "__notes__", ()):
            error.add_note(where)
        return error
    wrapped = SessionError(f"{what} failed: {type(error).__name__}: {error}")
    wrapped.__cause__ = error
    return wrapped


STALE_ROUNDS = 3
"""A peer silent for fewer of this learner's rounds than this still counts in ``N``."""


@dataclass(frozen=True)
class Merge:
    """A finished exchange of one fragment, to apply on the training thread.

    Attributes:
        fragment: which part of the model it changes.
        delta: the fragment's logical state after this fold minus the snapshot, per piece.
        weights: ``{learner: samples}`` newly folded into the fragment as this learner sees it,
            this learner included.
    """

    fragment: Fragment
    delta: dict[str, Tensor]
    weights: dict[str, int]

    def apply_to(self, model: torch.nn.Module) -> None:
        """Add ``delta`` to the live model: local progress made meanwhile stays."""
        self.fragment.add_into(model, self.delta)


FOLD_LANES = 4
"""The most fragments one job folds at once (``FoldLanes`` says how many it does). A fold waits
mostly on round trips (a claim, a listing, a read, a create): one after another, the folds of
many fragments on a far store outlast the interval (256 fragments of 0.26 s each take 67 s, past
``every=60 s``); four at a time they take a quarter of it. A fold's own state is its fragment's;
what the folds share is locked."""


class FoldLanes:
    """How many folds of a job run at once: enough that each lane is busy half the time at most.

    A learner folds one fragment per slot (``every / fragments``). Folds longer than half a slot
    (a large model on a far store, thousands of fragments) fall behind one after another, so up
    to ``FOLD_LANES`` overlap. Folds far shorter than a slot (a small model, a near store) gain
    nothing from overlapping: on a busy CPU they only lengthen each other, and with them the
    claims that peers run into (more contributions left pending, more bytes read), so they run
    one at a time. The fold time is this learner's own, smoothed; until one is measured, one lane.
    """

    SMOOTHING = 0.25

    def __init__(self, limit: int = FOLD_LANES) -> None:
        self.limit = limit
        self._fold_s: float | None = None
        self._lock = threading.Lock()  # folds of one job end on several threads

    def folded(self, seconds: float) -> None:
        """A fold lasted ``seconds``."""
        with self._lock:
            old = self._fold_s
            self._fold_s = seconds if old is None else old + self.SMOOTHING * (seconds - old)

    def for_job(self, folds: int, slot_s: float) -> int:
        """Lanes for a job of ``folds`` folds, one of which is due every ``slot_s`` seconds."""
        fold_s = self._fold_s
        if fold_s is None or not math.isfinite(slot_s) or slot_s <= 0:
            return 1
        return max(1, min(self.limit, folds, math.ceil(2 * fold_s / slot_s)))


class Exchanger:
    """One learner's exchanges with the run's state; its methods run on the worker thread, the
    folds of one job on up to ``FOLD_LANES`` threads at once (each its own fragment: ``FoldLanes``).

    Args:
        mailbox: the run's store.
        learner_id: this learner's name (one key segment).
        outer: how progress becomes a contribution (one state per fragment: momentum).
        wire_dtype: the dtype the state is stored in (``None``: float32/float64).
        catch_up: measure progress from the run's state (True) or this model's own (False).
        max_staleness_s: seconds after which a silent member stops counting in ``N``.
        registers: this process writes the learner's member key (not the other ranks of a
            sharded group).
    """

    def __init__(
        self,
        mailbox: Mailbox,
        learner_id: str,
        *,
        outer: OuterOptimizer,
        wire_dtype: torch.dtype | None,
        catch_up: bool,
        max_staleness_s: float,
        registers: bool = True,
    ) -> None:
        self.mailbox = mailbox
        self.learner_id = learner_id
        self.outer = outer
        self.wire_dtype = wire_dtype
        self.catch_up = catch_up
        self.max_staleness_s = max_staleness_s
        self.registers = registers
        """This process writes the learner's member key (not the other ranks of a sharded group)."""
        self.chains: list[FragmentChain] = []
        self.known: list[State | None] = []
        """Per fragment, the newest version this learner read or wrote."""
        self.conflicts = 0
        """Versions lost to other writers so far (each left a contribution pending)."""
        self._plan: FragmentPlan | None = None
        self._outer_states: list[OuterState] = []
        self._anchors: list[dict[str, Tensor]] = []  # where this learner's progress is measured from
        self._tables: list[dict[str, Contribution]] = []  # each learner's line, as last seen
        self.joined_marks: tuple[tuple[UnitMark, ...], ...] = ()  # this learner's, per fragment, at enter
        self.joined_marks_object = False  # some of those came from a marks object
        self.joined_lines: tuple[Contribution | None, ...] = ()  # this learner's, per fragment, at enter
        self.trained_unstepped = False  # a fold found progress though the loop never called step()
        self._seqs: list[int] = []  # the sequence number of this learner's next contribution
        self._unsure: list[tuple[int, dict[str, Tensor]] | None] = []  # a fold whose outcome is unknown
        self._since: list[float] = []  # per fragment, when the progress not yet folded began (monotonic)
        self._members: Members | None = None  # the member list, refreshed once per round
        self._shared = threading.Lock()  # what a job's concurrent folds share (``FOLD_LANES``)
        self._life = SignsOfLife(learner_id)  # who counts in N, on this node's monotonic clock
        self._member: str | None = None
        self._active: list[int] = []  # per fragment, the largest N seen since its previous fold

    def enter(
        self, plan: FragmentPlan, initial: Mapping[str, Tensor]
    ) -> tuple[list[dict[str, Tensor]], Contribution | None]:
        """Join the run: each fragment's logical state (creating the base if none) and this
        learner's line that every fragment holds (a restarted learner continues from it)."""
        mailbox, me = self.mailbox, self.learner_id
        self._plan = plan
        count = len(plan)
        self.chains = [  # a shard's plan holds some of the run's fragments: each its own index
            FragmentChain(
                mailbox,
                fragment.index,
                plan.run_count,
                plan.stored_spec(i, self.wire_dtype),
                wire_dtype=self.wire_dtype,
                shards=plan.shards,
            )
            for i, fragment in enumerate(plan.fragments)
        ]
        members = check_prefix(mailbox)
        listed = self._life.clock()
        views = parallel(lambda chain: chain.view(), self.chains, lanes=4)
        states = []
        for chain, view, fragment in zip(self.chains, views, plan.fragments):
            if view is None:
                base = chain.create_base({p.name: _slice(initial[p.name], p) for p in fragment.pieces}, me)
                view = chain.view(base)
            states.append(view)
        if self.registers:
            joined = time.time()
            self._member = member_key(me, joined)
            mailbox.put(self._member, MemberRecord.new(me, joined).to_bytes())
        # An earlier incarnation's member key stays: N counts a learner once whatever its keys,
        # and the key may be a live process's (a duplicate refused later must not unseat it).
        self.known = [view.base for view in states]
        self._tables = [view.learners for view in states]
        values = [logical(view) for view in states]
        if self.catch_up:
            self._anchors = [dict(v) for v in values]
        else:
            self._anchors = [
                {p.name: _slice(initial[p.name], p) for p in fragment.pieces} for fragment in plan.fragments
            ]
        self._seqs = [view.seq_of(me) + 1 for view in states]
        self._unsure = [None] * count
        now = self._life.clock()
        self._since = [now] * count
        self._outer_states = [self.outer.start() for _ in range(count)]
        self._life.listed(members, listed)
        for index, table in enumerate(self._tables):
            self._life.read(index, table, now)
        counted = [
            self._life.counted(members, table, staleness=self.max_staleness_s, since=now, now=now)
            for table in self._tables
        ]
        self._active = [len(learners) for learners in counted]
        # A restarted learner continues from what every fragment holds (as consensus counts):
        # batches folded into some fragments only, before a crash, are trained again by whoever
        # continues their units, and counted once, by that node.
        own = [table.get(me) for table in self._tables]
        self.joined_lines = tuple(own)
        self.joined_marks = tuple(lines_marks(mailbox, me, own))
        self.joined_marks_object = any(line is not None and line.marks is not None for line in own)
        held = None if None in own or not own else min(own, key=lambda entry: (entry.samples, entry.step))
        return values, held

    def exchange(
        self,
        index: int,
        snapshot: Mapping[str, Tensor],
        totals: tuple[int, int],
        final: bool,
        taken: float,
        units: tuple[UnitMark, ...] = (),
        marks: MarksRef | None = None,
        marked: tuple[int, int] | None = None,
        *,
        before_create: Callable[[float], None] | None = None,
    ) -> Merge:
        """Fold the progress in ``snapshot`` (fragment ``index``, taken at ``taken`` on the
        monotonic clock) into the run; ``totals`` is ``(steps, samples)``, ``units`` the
        snapshot's unit marks (or ``marks``, the object that holds them: ``session.marks_store``),
        ``marked`` the totals those marks are of when earlier (``Contribution.marked``),
        ``before_create`` the queue guard's check before each write (``FragmentChain.fold``)."""
        me, chain, anchor = self.learner_id, self.chains[index], self._anchors[index]
        local = {name: snapshot[name].to(anchor[name].dtype) - anchor[name] for name in anchor}
        if totals[0] == 0 and any(bool(tensor.any()) for tensor in local.values()):
            self.trained_unstepped = True  # the model moved, yet no session.step() was counted
        for name, tensor in local.items():  # never spread a diverged model to every node
            if not all_finite(tensor):
                raise SessionError(
                    f"learner {me!r}: this node's own parameters hold NaN or Inf in {name!r} "
                    "(local training diverged: lower the learning rate, clip gradients); nothing "
                    "was folded into the run, whose state stays finite"
                )
        reads = [lambda: chain.view(self.known[index], absorb=ABSORB, me=me, claim=True)]
        if self._members_due(index):
            reads.append(lambda: list_members(self.mailbox))
        view, *listed = parallel(lambda read: read(), reads)
        now = self._life.clock()
        if listed:
            with self._shared:
                self._members = listed[0]
                self._life.listed(self._members, now)
        members = self._members
        if view is None:
            raise SessionError(
                f"learner {me!r}: the run's state of fragment {index} on {describe(self.mailbox)} is gone "
                "(was the prefix deleted mid-run?)"
            )
        unsure = self._unsure[index]
        if unsure is not None:  # an earlier fold failed with an unknown outcome: did it land?
            seq, progress = unsure
            if view.seq_of(me) >= seq:  # it did: that progress is in the run already
                for name, tensor in progress.items():
                    local[name] -= tensor
                self._seqs[index] = seq + 1
            self._unsure[index] = None
        if view.seq_of(me) >= self._seqs[index]:
            # A fold of an earlier incarnation that landed after this one joined (a request sent
            # before it died, answered later): its batches are trained again from the marks
            # read at enter (``FoldGate.take_join_marks``) and counted once, by this line.
            logging.getLogger("gradientmail.session").warning(
                "learner %r: fragment %d holds a fold of its earlier incarnation that landed after "
                "it joined; continuing after it (those batches are counted once, by this learner)",
                me,
                index,
            )
            self._seqs[index] = view.seq_of(me) + 1
        # N for the progress made between the previous snapshot and this one, however late
        # this fold runs: learners that left since still count for it.
        since, self._since[index] = self._since[index], taken
        staleness = self._staleness(now - since)
        with self._shared:
            self._life.read(index, view.table, now)
            active = self._life.counted(members, view.table, staleness=staleness, since=since, now=now)
            scale = self._scale_for(index, len(active))
        seq = self._seqs[index]
        self._unsure[index] = (seq, {name: t.clone() for name, t in local.items()})
        contribution = self._outer_states[index](local, scale)
        entry = Contribution(
            seq=seq,
            step=totals[0],
            samples=totals[1],
            time=time.time(),
            final=final,
            units=units,
            marks=marks,
            marked=marked,
        )
        folded = chain.fold(view, me, contribution, entry, before_create=before_create)
        self._unsure[index] = None
        self._seqs[index] = folded.learners[me].seq + 1  # past a slot a peer closed (``chain.fold``)
        with self._shared:
            self.conflicts += folded.conflicts
        self.known[index] = folded.base
        if final:
            chain.settle(folded.base.header.version)
        before, self._tables[index] = self._tables[index], folded.learners
        self._anchors[index] = folded.tensors
        delta = {name: value - snapshot[name].to(value.dtype) for name, value in folded.tensors.items()}
        weights = {}
        for learner, line in folded.learners.items():
            old = before.get(learner)
            gained = line.samples - (old.samples if old is not None else 0)
            if gained > 0 or (learner == me and gained >= 0):
                weights[learner] = gained
        return Merge(fragment=self._plan.fragments[index], delta=delta, weights=weights)

    def _members_due(self, index: int) -> bool:
        """Whether the fold of fragment ``index`` lists the members (beside its view).

        The first fold lists them (who joined since this learner entered counts in its ``N``
        from the start); after that the member list changes rarely, and each round lists it once,
        with fragment 0. That fold's slot falls anywhere in the round (a learner's round starts at
        a random fragment), so the listings of learners that started together spread over the
        interval instead of coming in the same slot (``N`` listings of ``N / 1000`` pages each on
        one prefix).
        """
        return self._members is None or index == 0

    def _staleness(self, round_s: float) -> float:
        """Seconds of silence after which a peer stops counting: ``max_staleness``, or three of
        this learner's own rounds (``round_s``: since its previous snapshot of this fragment)
        when longer.

        Peers exchange at about this learner's cadence, so a peer silent for less than three
        rounds is alive; without this, exchanging less often than ``max_staleness`` would make
        every peer look stale between folds and shrink ``N`` (progress counted several times).
        """
        return max(self.max_staleness_s, STALE_ROUNDS * round_s)

    def _scale_for(self, index: int, active: int) -> int:
        """``N`` for fragment ``index``'s progress since its previous fold: the largest seen since.

        Never overshoots: progress made among four learners still counts 1/4 after the others
        left, and a learner that just joined does not yet inflate the others' contributions.
        """
        self._active = [max(seen, active) for seen in self._active]
        scale, self._active[index] = self._active[index], active
        return scale

    def leave(self) -> None:
        """Delete this learner's member key, so peers stop counting it in ``N``."""
        if self._member is not None:
            self.mailbox.delete(self._member)
            self._member = None

    def samples_in_run(self) -> int:
        """This learner's samples whose progress every fragment of the run holds (as consensus counts)."""
        own = [table.get(self.learner_id) for table in self._tables]
        return 0 if not own or None in own else min(entry.samples for entry in own if entry is not None)

    def put_progress(self, progress: dict[str, Any]) -> None:
        """Write this learner's progress record (what ``gradientmail status`` shows)."""
        figures = meeting_point(self.mailbox, self.learner_id).queue_figures()  # from its queue, if any
        record = ProgressRecord.new(
            progress,
            units=figures.units,
            samples_in_run=self.samples_in_run(),
            unit_spans=figures.unit_spans,  # when and for how long this learner trained its recent units
        )
        self.mailbox.put(progress_key(self.learner_id), record.to_bytes())


def logical(view: View) -> dict[str, Tensor]:
    """A fragment's values in ``view``: its base plus the pending contributions, summed."""
    values = widen(view.base.tensors)
    for pending in view.absorbed:
        for name, tensor in pending.tensors.items():
            values[name] += tensor.to(values[name].dtype)
    return values


def _slice(tensor: Tensor, piece: Piece) -> Tensor:
    return tensor.reshape(-1)[piece.start : piece.stop]
