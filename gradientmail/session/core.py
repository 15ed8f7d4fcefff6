"""``Session``: the training-thread side (enter, ``step()``, exit).

Mailbox work runs on one background thread (``session.exchange``); this side snapshots the
model, hands the snapshot over, and applies each finished exchange at a step boundary.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from gradientmail.errors import GradientMailError, LeaseLostError, SessionError
from gradientmail.fold_gate import FoldGate
from gradientmail.layout import member_key, pending_key, progress_key
from gradientmail.learner_id import default_learner_id
from gradientmail.mailbox.base import Mailbox, describe
from gradientmail.mailbox.keys import validate_key
from gradientmail.meeting_point import meeting_point
from gradientmail.presence import SESSION, PresenceShare
from gradientmail.session.exchange import Exchanger, FoldLanes, Job, Merge, Worker, surface
from gradientmail.session.fragments import MAX_FRAGMENTS, FragmentPlan, accumulation_dtype, float_state
from gradientmail.session.group import (
    APPLY,
    FAILED,
    LEASE_LOST,
    NOTHING,
    TIMED_OUT,
    GroupSync,
    PendingStep,
    StepWord,
    WordPace,
)
from gradientmail.session.marks_store import MarksWriter
from gradientmail.session.options import (
    DEFAULT_EVERY,
    DEFAULT_MAX_STALENESS,
    DEFAULT_TIMEOUT,
    ENV_EVERY,
    ENV_EVERY_STEPS,
    ENV_FRAGMENTS,
    ENV_MAX_STALENESS,
    ENV_OUTER,
    ENV_TIMEOUT,
    env_override,
    positive_seconds,
    retire_after_s,
    seconds,
)
from gradientmail.session.outer import OuterOptimizer, resolve_outer
from gradientmail.session.overlap import parallel
from gradientmail.session.queue_guard import QueueGuard
from gradientmail.session.schedule import Schedule
from gradientmail.session.shards import (
    AheadFragments,
    NoPresence,
    PendingShardStep,
    ShardProgress,
    ShardSync,
    shard_layout,
    shard_plan,
)

LATEST_JOIN = 10**13 - 0.001
"""A joining time (unix seconds) with as many digits as any this code will see: the longest member key."""

log = logging.getLogger("gradientmail.session")
"""Joining and leaving at INFO, every exchange at DEBUG; the library never configures handlers."""


class Session:
    """Keeps nodes that train on different data one model, without making any of them wait.

    Each exchange folds this node's progress (``/ N``) into the run's state in the mailbox, in
    the background; ``step()`` applies the result. The state is cut into fragments, each
    exchanged once per interval on its own staggered schedule, starting at a random phase.
    Details: ``docs/session.md``.

    Args:
        model: the module being trained; its floating-point ``state_dict`` entries are exchanged.
        mailbox: the same store for every node.
        learner_id: this process's name in the run, one key segment; default
            ``default_learner_id()`` (host name + launcher rank), as ``shared_queue``'s.
        every: exchange when this much time has passed since the last one (``None``: by steps).
        every_steps: exchange every this many ``step()`` calls (``None``: by time); with both,
            whichever is due first.
        max_staleness: a member silent for this long no longer counts in ``N``.
        timeout: the longest wait for the background thread.
        catch_up: on enter, load the run's state (the first node's model becomes the base).
        outer: ``"delayed_nesterov"`` (default), ``"average"`` or an ``OuterOptimizer``.
        wire_dtype: ``None`` (float32 state) or ``torch.bfloat16`` (half the bytes).
        fragments: how many fragments the state is cut into (``None``: one per 64 KiB of
            float32 state, at most 16); every node of a run must use the same. Of a sharded
            model: how many each rank's shard is cut into.
        group: a ``torch.distributed`` process group whose ranks train this model in lockstep
            (DDP): they are one learner (rank 0's ``learner_id``), its rank 0 alone talks to the
            store, and every rank applies each exchange at the same ``step()``. Every rank
            enters, steps, waits and leaves together (``docs/session.md``, Multi-GPU machines).
            A model sharded over the group with FSDP2 (``fully_shard``): every rank exchanges
            its own shard, and no rank ever gathers the whole model.

    The ``ENV_*`` environment variables override the matching arguments when set.

    Raises:
        SessionError: on ``step()``, ``wait()`` or exit, for a failed background exchange.

    Example:
        >>> import torch
        >>> from gradientmail import MemoryMailbox, Session, consensus
        >>> box, model = MemoryMailbox("doctest-session"), torch.nn.Linear(2, 1)
        >>> box.clear()
        >>> with Session(model, mailbox=box, learner_id="node-0", every_steps=1) as session:
        ...     session.step(samples=32)
        ...     session.wait()
        >>> session.steps, session.exchanges, session.fragments
        (1, 2, 1)
        >>> consensus(box, torch.nn.Linear(2, 1))
        {'node-0': 32}
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        mailbox: Mailbox,
        learner_id: str | None = None,
        every: timedelta | None = DEFAULT_EVERY,
        every_steps: int | None = None,
        max_staleness: timedelta = DEFAULT_MAX_STALENESS,
        timeout: timedelta = DEFAULT_TIMEOUT,
        catch_up: bool = True,
        outer: str | OuterOptimizer = "delayed_nesterov",
        wire_dtype: torch.dtype | None = None,
        fragments: int | None = None,
        group: Any = None,
    ) -> None:
        if not callable(getattr(model, "state_dict", None)):
            raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
        if not isinstance(mailbox, Mailbox):
            raise TypeError(
                f"mailbox must have the Mailbox methods (put_if_absent, get, put, list, delete); "
                f"got {type(mailbox).__name__}"
            )
        learner_id = default_learner_id() if learner_id is None else learner_id
        if not isinstance(learner_id, str) or "/" in learner_id:
            raise ValueError(f"learner_id must be one key segment without '/', not {learner_id!r}")
        # The longest keys this learner will write, checked now rather than at enter or mid-run.
        validate_key(progress_key(learner_id))
        validate_key(member_key(learner_id, LATEST_JOIN))
        validate_key(pending_key(MAX_FRAGMENTS - 1, learner_id, 0))
        every = env_override(ENV_EVERY, every, seconds, "a number of seconds")
        every_steps = env_override(ENV_EVERY_STEPS, every_steps, int, "a step count")
        max_staleness = env_override(ENV_MAX_STALENESS, max_staleness, seconds, "a number of seconds")
        timeout = env_override(ENV_TIMEOUT, timeout, seconds, "a number of seconds")
        fragments = env_override(ENV_FRAGMENTS, fragments, int, "a fragment count")
        retire_after_s(0.0)  # a malformed GRADIENTMAIL_SESSION_RETIRE_AFTER_S fails here, not at enter
        if fragments is not None and (
            isinstance(fragments, bool) or not isinstance(fragments, int) or not 1 <= fragments <= MAX_FRAGMENTS
        ):
            raise ValueError(f"fragments must be None or an int in [1, {MAX_FRAGMENTS}], not {fragments!r}")
        if every_steps is not None and (
            isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 1
        ):
            raise ValueError(f"every_steps must be None or an int >= 1, not {every_steps!r}")
        if every is None and every_steps is None:
            raise ValueError("every and every_steps are both None: the session would never exchange")
        if wire_dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(f"wire_dtype must be None, torch.float32 or torch.bfloat16, not {wire_dtype!r}")
        self.model = model
        self.mailbox = mailbox
        self.learner_id = learner_id
        self.every = every
        self.every_steps = every_steps
        self.max_staleness = max_staleness
        self.timeout = timeout
        self.catch_up = catch_up
        self.outer = resolve_outer(os.environ.get(ENV_OUTER, "").strip() or outer)
        self.wire_dtype = wire_dtype
        self._fragments_asked = fragments
        self._plan: FragmentPlan | None = None
        self._every_s = positive_seconds("every", every, optional=True)
        self._every_steps = math.inf if every_steps is None else every_steps
        self._max_staleness_s = positive_seconds("max_staleness", max_staleness)
        self._timeout_s = positive_seconds("timeout", timeout)

        self._state = "new"  # new -> active -> closed
        self._steps = 0
        self._samples = 0
        self._exchanges = 0
        self._merges = 0
        self._job: Job | None = None
        self._guard = QueueGuard(FoldGate(), learner_id)  # to this learner's queue, once entered
        self._presence: PresenceShare | NoPresence | None = None  # this process registers the learner, once entered
        self._stuck = False
        self._schedule: Schedule | None = None  # when to exchange which fragment, once entered
        self._lanes = FoldLanes()  # how many folds of a job run at once
        self._paced: tuple[float, int] | None = None  # (clock, steps) at the previous job: the step pace
        self._last_weights: dict[str, int] = {}
        self._buffers: list[dict[str, Tensor]] = []  # per fragment, the snapshot, reused
        self._marks = MarksWriter(mailbox, learner_id)  # used on the exchange thread only
        self._landed: list[Merge] = []  # folds that landed, their merges not applied yet
        self._landed_lock = threading.Lock()
        self._group = None if group is None else GroupSync(group)
        self._layout = shard_layout(model)  # sharded (FSDP2): every rank exchanges its own shard
        if self._layout is not None and (
            self._group is None or (self._layout.rank, self._layout.shards) != (self._group.rank, self._group.size)
        ):
            raise ValueError(
                "a model sharded with FSDP2 needs group= set to the process group it is sharded over "
                "(the ranks of its device mesh, in the same order)"
            )
        self._shard_sync = None if self._layout is None or self._group is None else ShardSync(self._group)
        self._registers = self._group is None or self._group.leads  # presence, member, progress, queue
        self._exchanger = Exchanger(  # the background side: its methods run on self._worker only
            mailbox,
            learner_id,
            outer=self.outer,
            wire_dtype=wire_dtype,
            catch_up=catch_up,
            max_staleness_s=self._max_staleness_s,
            registers=self._registers,
        )
        # A follower of a replicated (DDP) group never talks to the store: its rank 0 exchanges for it.
        self._follows = self._group is not None and self._layout is None and not self._group.leads
        self._pending: PendingStep | PendingShardStep | None = None  # the group's word of the last step, in flight
        self._shard_progress: ShardProgress | None = None  # a sharded group's: how far every shard holds its steps
        self._ahead = AheadFragments({})  # a sharded group's: own fragments holding steps it trains again
        self._joined_values: list[dict[str, Tensor]] = []  # a sharded group's: each fragment's, read on entering
        self._announced: Job | None = None  # the exchange that word told the group to apply
        self._held: BaseException | None = None  # rank 0's error that word told every rank to raise
        self._unsent = 0  # in a group: this rank's samples since its last word
        self._next_word = 0  # in a group: the step of the next word (every rank knows it alike)
        self._gap = 1  # in a group: steps from this word step to the next, as the last word read said
        self._pace = WordPace()  # rank 0 of a group: how far apart it asks for the words
        self._word_at = 0.0  # in a group: time.monotonic() at the last word step
        self._word_span = 0.0  # in a sharded group: seconds between the last two word steps

    # -- read-only state -------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """``step()`` calls, continued across restarts of the same learner."""
        return self._steps

    @property
    def samples(self) -> int:
        """Samples reported to ``step()``, continued across restarts of the same learner."""
        return self._samples

    @property
    def exchanges(self) -> int:
        """Fragment exchanges completed (progress folded into the run's state) since enter.

        Each interval exchanges every fragment once: ``exchanges / fragments`` whole exchanges.
        """
        return self._exchanges

    @property
    def fragments(self) -> int | None:
        """How many fragments the state is cut into (known once entered)."""
        return None if self._plan is None else len(self._plan)

    @property
    def merges(self) -> int:
        """Exchanges that brought in progress of at least one other learner."""
        return self._merges

    @property
    def conflicts(self) -> int:
        """Versions of the run's state lost to other writers (each cost one more read)."""
        return self._exchanger.conflicts

    @property
    def version(self) -> int | None:
        """The version of fragment 0 of the run's state this node last read or wrote."""
        known = self._exchanger.known
        return None if not known or known[0] is None else known[0].header.version

    @property
    def last_weights(self) -> dict[str, int]:
        """``{learner: samples}`` newly folded into the run by the last exchange, this one included."""
        return dict(self._last_weights)

    @property
    def in_flight(self) -> bool:
        """True while a background exchange is running or its result awaits the next step."""
        return self._job is not None

    def __repr__(self) -> str:
        return (
            f"Session(learner_id={self.learner_id!r}, mailbox={describe(self.mailbox)}, "
            f"outer={self.outer.name!r}, steps={self._steps}, samples={self._samples}, {self._state})"
        )

    # -- enter / exit ------------------------------------------------------------------------
    def __enter__(self) -> Session:
        if self._state != "new":
            raise SessionError(f"Session {self.learner_id!r} was already entered; create a new one")
        group = self._group
        if group is None:
            return self._join()
        self.learner_id = group.agree(self.learner_id)
        if self._shard_sync is not None:
            return self._join_shard(self._shard_sync)
        if self._follows:
            self._plan = FragmentPlan.of(self.model, self._fragments_asked)
            joined, self._steps, self._samples = group.announce([0, 0, 0])
            if not joined:
                raise SessionError(f"rank 0 of the group of learner {self.learner_id!r} failed to join the run")
            group.share(self.model, self._plan.fragments)
            self._state = "active"
            return self
        try:
            self._join()
        except BaseException:
            group.announce([0, 0, 0])
            raise
        group.announce([1, self._steps, self._samples])
        group.share(self.model, self._plan.fragments)
        return self

    def _join_shard(self, sync: ShardSync) -> Session:
        """Enter for one rank of a sharded group: each joins with its own shard, then all agree.

        A restarted group continues where its queue's unit marks stand (rank 0's lines say at
        which totals, ``Contribution.resumes_at``), the earliest point every fragment of every
        shard holds; a fragment that holds more does not take the steps after it twice
        (``AheadFragments``).
        """
        try:
            self._join()
        except BaseException:
            sync.all_ok(False)
            raise
        if not sync.all_ok(True):
            self._leave(SessionError, SessionError("another rank failed to join"), None)
            raise SessionError(f"another rank of the group of learner {self.learner_id!r} failed to join the run")
        lines = self._exchanger.joined_lines
        held = [0 if line is None else line.step for line in lines]
        resume = (0, 0) if not lines or None in lines else min(line.resumes_at for line in lines if line is not None)
        self._steps, self._samples = sync.least(*resume)
        if self._registers and self._steps < resume[0]:  # the queue resumes at rank 0's marks
            warnings.warn(
                f"learner {self.learner_id!r}: a shard of its group holds its steps only up to {self._steps}, "
                f"where its queue's marks stand at step {resume[0]}: that shard misses the batches between "
                "(its fragments' lines were rewritten or lost)",
                stacklevel=3,
            )
        self._samples_at_enter = self._samples
        values, self._joined_values = self._joined_values, []
        if self.catch_up:  # the model holds the run's values: those of a fragment ahead are kept to go back to
            self._ahead = AheadFragments({f: (step, values[f]) for f, step in enumerate(held) if step > self._steps})
        assert self._group is not None and self._plan is not None and self._guard.link is not None
        mark, units = self._guard.link.snapshot()
        self._shard_progress = ShardProgress(self._group, held, self._steps, self._samples, mark, tuple(units.values()))
        if self._ahead:
            log.info(
                "%s: %d fragment(s) of this shard already hold steps the group trains again (up to step %d); "
                "they skip them",
                self.learner_id,
                len(self._ahead),
                max(held),
            )
        return self

    def _join(self) -> Session:
        entries = float_state(self.model)
        if not entries:
            raise ValueError("the model has no floating-point parameters or buffers to exchange")
        if self._layout is None:
            plan = self._plan = FragmentPlan.of(self.model, self._fragments_asked)
        else:
            plan = self._plan = shard_plan(self.model, self._layout, self._fragments_asked)
        self._buffers = [{} for _ in plan.fragments]
        initial = {name: t.detach().to("cpu", accumulation_dtype(t.dtype), copy=True) for name, t in entries.items()}
        exchanger = self._exchanger
        # One live process per learner id: a second one is refused here, before it reads or
        # writes anything of the run (shared with this learner's queue in this process).
        registers = self._registers
        presence = self._presence = PresenceShare(self.mailbox, self.learner_id, SESSION) if registers else NoPresence()
        presence.start()
        try:
            self._worker = Worker(f"gradientmail-session-{self.learner_id}")
        except BaseException:
            presence.close()
            raise
        self._started_wall = time.time()
        self._started = time.monotonic()
        try:
            values, own = self._wait(self._worker.submit(lambda: exchanger.enter(plan, initial)), "joining the run")
            if self.catch_up:
                for fragment, value in zip(plan.fragments, values):
                    fragment.load_into(self.model, value)
            if self._shard_sync is not None:
                self._joined_values = values
            if own is not None:  # a restarted learner continues its totals
                self._steps = own.step
                self._samples = own.samples
            self._samples_at_enter = self._samples
            # A first progress record: `gradientmail status` lists this learner from the start.
            if registers:
                progress = self._progress(finished=False)
                self._wait(self._worker.submit(lambda: exchanger.put_progress(progress)), "writing progress")
        except BaseException:
            self._worker.close(0)
            presence.close()
            raise
        # The queue of this learner in this process records a batch as done once folded.
        # (Another rank of a sharded group has no queue: a gate of its own, never shared.)
        gate = meeting_point(self.mailbox, self.learner_id).gate if registers else FoldGate()
        self._guard = QueueGuard(gate, self.learner_id)
        self._guard.attach(self._fold_now, len(plan), self._wait_for_fold, exchanger.joined_marks)
        # A random phase: learners that joined together do not exchange (and collide) together.
        self._schedule = Schedule(len(plan), every_s=self._every_s, every_steps=self._every_steps, steps=self._steps)
        self._state = "active"
        how = "caught up" if self.catch_up else "own parameters"
        what = "%s joined the run on %s at version %s (%s, %d fragments, outer %s)"
        log.info(what, self.learner_id, describe(self.mailbox), self.version, how, len(plan), self.outer.name)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        group = self._group
        if self._shard_sync is not None:
            return self._leave_shard(self._shard_sync, exc_type, exc, tb)
        if group is not None and (exc is not None or self._state != "active"):
            # After an exception the ranks may not all be here: no new collective (the launcher
            # stops the group), but none left in flight either (the group may be torn down next).
            pending, self._pending = self._pending, None
            if pending is not None:
                pending.settle()
        if self._follows and self._state == "active":
            self._state = "closed"
            if exc is not None:
                return False
        elif group is None or exc is not None or self._state != "active":
            # rank 0 leaves as a learner does after a failed body.
            return self._leave(exc_type, exc, tb)
        try:
            self._group_last_word()  # the last steps' samples and what rank 0 announced
        except BaseException as error:  # raised on every rank alike: leave as after a failed body
            if not self._follows:
                self._leave(type(error), error, error.__traceback__)
            raise
        if self._follows:
            if not group.announce([0])[0]:
                raise SessionError(f"rank 0 of the group of learner {self.learner_id!r} failed to leave the run")
            group.share(self.model, self._plan.fragments)
            return False
        left = False
        try:
            self._leave(exc_type, exc, tb)
            left = True
        finally:
            group.announce([int(left)])
            if left:  # every rank ends on the model of the final fold
                group.share(self.model, self._plan.fragments)
        return False

    def _leave_shard(self, sync: ShardSync, exc_type, exc, tb) -> bool:
        """Leave for one rank of a sharded group: each folds its own shard a last time, then all
        agree that every rank did (after an exception, no collective: the ranks may not all be here)."""
        if exc is not None or self._state != "active":
            pending, self._pending = self._pending, None
            if pending is not None:  # none left in flight: the group may be torn down next
                pending.settle()
            return self._leave(exc_type, exc, tb)
        left = False
        try:
            if self._pending is not None:  # the last word: its samples count in the final fold
                self._count(self._pending)
            assert self._shard_progress is not None
            self._pending = self._shard_progress.start(self._steps, self._unsent)  # and the samples since
            self._unsent = 0
            self._count(self._pending)
            self._pending = None
            self._leave(None, None, None)
            left = True
        finally:
            everyone = sync.all_ok(left)
        if not everyone:
            raise SessionError(f"another rank of the group of learner {self.learner_id!r} failed to leave the run")
        return False

    def _leave(self, exc_type, exc, tb) -> bool:
        if self._state != "active":
            return False
        self._state = "closed"
        job, self._job = self._job, None
        folded_all = False  # the final fold landed: every batch delivered is in the run
        try:
            if exc is None and self._guard.revoked:
                log.warning(
                    "%s left the run without a final fold: its queue stopped without recording its last "
                    "batches, which whoever continues its units trains again",
                    self.learner_id,
                )
                if job is not None and job.done.wait(self._timeout_s):
                    with contextlib.suppress(GradientMailError):  # already leaving on a warning
                        self._apply(job, "the last exchange")
                self._worker.submit(self._exchanger.leave).done.wait(self._timeout_s)
            elif exc is None:
                self._presence.check()  # replaced by another process of this learner: no final fold
                if job is not None:
                    self._wait(job, "the last exchange", apply=True)
                final = self._worker.submit(self._exchange_job_for_now(range(len(self._plan)), final=True))
                self._wait(final, "folding the final progress", apply=True)
                folded_all = True
                if self._exchanger.trained_unstepped:
                    warnings.warn(
                        f"Session {self.learner_id!r}: the model was trained but session.step() was never "
                        "called, so this learner's progress counts 0 samples in the run (status, "
                        "consensus) and was never exchanged before leaving: call "
                        "session.step(samples=len(batch)) after each optimizer step",
                        stacklevel=2,
                    )
                what = "%s left the run at version %s after %d steps, %d exchanges, %d conflicts"
                log.info(what, self.learner_id, self.version, self._steps, self._exchanges, self.conflicts)
            else:
                log.warning("%s left the run after an exception in the training loop: %r", self.learner_id, exc)
                # Nothing final after a failed body (as after a crash, its progress up to its last
                # exchange stays in the run); keep the body's exception, note the background's.
                note = None
                background = f"the background exchange of learner {self.learner_id!r}"
                if job is not None and not job.done.wait(self._timeout_s):
                    self._stuck = True
                    note = f"{background} was still running after {self.timeout}"
                elif job is not None and job.error is not None:
                    note = f"{background} had also failed: {job.error!r}"
                if note and hasattr(exc, "add_note"):
                    exc.add_note(note)
                if not self._stuck:  # leave the member list, so peers stop counting this node
                    self._worker.submit(self._exchanger.leave).done.wait(self._timeout_s)
        finally:
            if folded_all and self._registers and self._guard.link is not None and not self._guard.link.snapshot()[1]:
                # Every record is written (the queue has left): no marks object is needed any more.
                earlier = self._exchanger.joined_marks_object  # an earlier incarnation's objects
                self._worker.submit(lambda: self._marks.clear(earlier=earlier)).done.wait(self._timeout_s)
            # After the final fold every batch delivered is in the run; after a failure nothing
            # more is released (the queue drops those records: their batches are trained again).
            self._guard.detach(release=folded_all)
            # An idle thread ends at once; a stuck one (a store that never answers) is a daemon
            # and is left behind rather than waited for again.
            self._worker.close(0 if self._stuck else self._timeout_s)
            self._presence.close()  # the last holder of this process marks the record stopped
        return False

    # -- the training thread -----------------------------------------------------------------
    def step(self, samples: int) -> None:
        """Count one optimizer step; apply a finished exchange; start the next one when due.

        Args:
            samples: what this step trained on, in a unit every node uses alike (sequences).

        Raises:
            GradientMailError: a failure of the background exchange (``MailRejectedError``,
                ``MailboxError``, or ``SessionError`` wrapping anything else).
        """
        if self._state != "active":
            raise SessionError(f"Session {self.learner_id!r}: call step() inside `with session:`")
        if samples.__class__ is not int:
            samples = _samples(samples)
        if samples < 0:
            raise ValueError(f"samples must be >= 0, not {samples}")
        self._steps += 1
        counted = True  # the samples counted to this step: a fold may start
        if self._shard_sync is not None:
            if self._ahead:
                self._ahead.reached(self._steps, self._plan, self.model)
            counted = self._shard_step(samples)
        elif self._group is not None:
            self._group_step(samples)
            return
        else:
            self._samples += samples
        self._guard.stepped()  # frozen past a lease (units taken over)? fold nothing more then
        job = self._job
        if job is not None:
            if not job.done.is_set():
                return
            self._job = None
            self._apply(job, "a background exchange")
        if self._guard.revoked:
            return  # the queue stopped uncleanly: nothing more is folded
        if counted and self._schedule.due(self._steps):
            self._presence.check()  # replaced by another process of this learner (after a freeze)?
            if self._pending is not None:  # a sharded group: the fold records the group's samples to this step
                self._count(self._pending)  # (started at this word step: every sample so far)
            due = self._ahead.foldable(self._due_fragments(self._word_span))
            if due:
                self._job = self._worker.submit(self._exchange_job_for_now(due, final=False))

    def _shard_step(self, samples: int) -> bool:
        """Count the group's samples: at a word step, read the previous sum and start the next
        (True: a fold may start now, its count exact).

        Each rank of a sharded group exchanges its own shard on its own schedule, as fragments
        of one model are; the ranks need to agree only on the learner's sample count, a sum
        that runs beside the training of the steps to the next word step (``session.group``)."""
        progress = self._shard_progress
        assert progress is not None and self._plan is not None
        self._unsent += samples
        if self._steps < self._next_word:
            return False
        began = time.perf_counter()
        pending = self._pending
        if pending is not None:
            self._gap = self._count(pending).every
        waited = time.perf_counter() - began
        link = self._guard.link
        if self._registers and link is not None:
            if isinstance(pending, PendingShardStep):
                progress.read(pending, self._samples)
            mark, units = link.snapshot()
            progress.stepped(self._steps, mark, tuple(units.values()))
        every = self._pace.every() if self._group is not None and self._group.leads else 0
        starting = time.perf_counter()
        self._pending = progress.start(self._steps, self._unsent, every)
        self._unsent = 0
        now = time.monotonic()
        self._word_span, self._word_at = now - self._word_at, now
        self._next_word = self._steps + self._gap
        if every:
            self._pace.spent(waited + time.perf_counter() - starting, began, self._steps)
        return True

    def _group_step(self, samples: int) -> None:
        """``step()`` in a group: at a word step, read the previous word and start the next.

        The word of word step k carries rank 0's news as of step k (an exchange finished, which
        fragments) and every rank's samples since the word before; every rank reads it at the
        next word step, after it ran beside the training of the steps between, and applies what
        it announced: all ranks apply the same exchange at the same step, and none waits for a
        collective of its own step. Rank 0 starts an exchange only at a word step, and waits for
        that step's word then (its count must be exact). Between word steps, a counter.
        """
        assert self._group is not None and self._plan is not None
        self._unsent += samples
        if not self._follows and self._held is None:
            try:
                self._guard.stepped()  # frozen past a lease (units taken over)? fold nothing more then
            except LeaseLostError as error:  # raised on every rank at the next word step
                self._held = error
        if self._steps < self._next_word:
            return
        began = time.perf_counter()
        if self._pending is not None:
            self._pending.word()  # timed apart from applying what it announced (a merge is no step cost)
        waited = time.perf_counter() - began
        self._group_flush()
        status, stop, fragments = NOTHING, NOTHING, []
        job = None if self._follows else self._job
        if job is not None and job is not self._announced and job.done.is_set():
            status = APPLY if job.error is None else FAILED
            with self._landed_lock:
                fragments = [merge.fragment.index for merge in self._landed]
            self._announced = job
        if self._held is not None:
            stop = LEASE_LOST
        every = 0 if self._follows else self._pace.every()
        starting = time.perf_counter()
        self._pending = self._group.start(self._unsent, status, fragments, len(self._plan), stop, every)
        self._unsent = 0
        self._next_word = self._steps + self._gap
        if self._follows or stop:
            return
        self._pace.spent(waited + time.perf_counter() - starting, began, self._steps)
        if self._guard.revoked:
            return  # the queue stopped uncleanly: nothing more is folded
        now, span = time.monotonic(), time.monotonic() - self._word_at
        self._word_at = now
        if self._job is None and self._schedule.due(self._steps):
            self._count(self._pending)  # the fold records the group's samples to this step
            self._job = self._worker.submit(self._exchange_job_for_now(self._due_fragments(span), final=False))

    def _group_last_word(self) -> None:
        """Leaving: read the word in flight, then sum the samples since (every rank, synchronously)."""
        assert self._group is not None and self._plan is not None
        self._group_flush()
        stop = NOTHING if self._held is None else LEASE_LOST
        self._pending = self._group.start(self._unsent, NOTHING, (), len(self._plan), stop)
        self._unsent = 0
        self._group_flush()

    def _count(self, pending: PendingStep | PendingShardStep) -> StepWord:
        word = pending.word()
        if not pending.counted:
            pending.counted = True
            self._samples += word.samples
        return word

    def _group_flush(self) -> None:
        """Read the word in flight (every rank, at the same point) and apply what it announced."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        word = self._count(pending)
        self._gap = word.every
        if word.status != NOTHING:
            self._group_apply(word)
        if word.stop != NOTHING:
            held, self._held = self._held, None
            if held is not None:  # rank 0
                raise held
            if word.stop == LEASE_LOST:
                raise LeaseLostError(
                    f"learner {self.learner_id!r}: rank 0 of its group lost its lease (peers took its units "
                    "over); every rank of the group stops"
                )
            raise SessionError(
                f"learner {self.learner_id!r}: the exchange in flight did not finish within wait()'s timeout "
                "on rank 0 of its group (the mailbox is slow or not answering)"
            )

    def _group_apply(self, word: StepWord) -> None:
        """Apply the exchange a word announced: rank 0 applies it, every rank takes its fragments."""
        assert self._group is not None and self._plan is not None
        announced, self._announced = self._announced, None
        try:
            if announced is not None and announced is self._job:  # not applied meanwhile (_fold_now)
                self._job = None
                self._apply(announced, "a background exchange")
        finally:
            self._group.share(self.model, [self._plan.fragments[i] for i in word.fragments])
        if word.status == FAILED and self._follows:
            raise SessionError(f"the exchange of learner {self.learner_id!r} failed on rank 0 of its group")

    def wait(self, timeout: timedelta | None = None, *, apply: bool = True) -> None:
        """Wait for the exchange in flight, if any, and apply it now (before an evaluation).

        In a group every rank calls it; rank 0 waits, then every rank applies together (in a
        sharded group, each rank waits for and applies its own shard's exchange).

        Args:
            timeout: the longest wait (default: the session's ``timeout``).
            apply: False to only wait; the next ``step()`` applies the result.

        Raises:
            SessionError: past ``timeout``, or what ``step()`` would raise.
        """
        if self._state != "active":
            raise SessionError(f"Session {self.learner_id!r}: call wait() inside `with session:`")
        if self._group is not None and self._shard_sync is None:
            self._group_wait(timeout, apply)
            return
        job = self._job
        if job is not None:
            limit = self._timeout_s if timeout is None else positive_seconds("timeout", timeout)
            job.done.wait(limit)
            # Past the limit the job stays in flight (owning the snapshot): a later call picks it up.
            self._raise_if_running(job, "the exchange in flight", limit)
            if apply:
                self._job = None
                self._apply(job, "the exchange in flight")

    def _group_wait(self, timeout: timedelta | None, apply: bool) -> None:
        assert self._group is not None and self._plan is not None
        self._group_flush()
        job = None if self._follows else self._job
        status, stop, fragments = NOTHING, NOTHING, []
        if self._held is not None:  # a lease lost since the last word step: every rank raises now
            stop = LEASE_LOST
        elif job is not None:
            limit = self._timeout_s if timeout is None else positive_seconds("timeout", timeout)
            job.done.wait(limit)
            if not job.done.is_set():  # every rank raises; the job stays in flight, as without a group
                try:
                    self._raise_if_running(job, "the exchange in flight", limit)
                except SessionError as error:
                    self._held, stop = error, TIMED_OUT
            elif apply:
                status = APPLY if job.error is None else FAILED
                with self._landed_lock:
                    fragments = [merge.fragment.index for merge in self._landed]
                self._announced = job
        self._pending = self._group.start(self._unsent, status, fragments, len(self._plan), stop)
        self._unsent = 0
        self._group_flush()
        self._next_word = self._steps + self._gap

    def _wait_for_fold(self) -> None:
        """Until the fold under way (if any) ended: the queue stopped uncleanly (``QueueGuard``)."""
        job = self._job
        if job is not None and not job.done.wait(self._timeout_s):
            self._stuck = True

    def _fold_now(self) -> None:
        """Fold every fragment now and wait: the queue's records of the last batches wait for it
        when the queue closes before the Session (called from the training thread)."""
        if self._state != "active" or self._guard.revoked:
            return
        if self._pending is not None:  # in a group: the last step's samples, for this fold's count
            self._count(self._pending)
        job, self._job = self._job, None
        if job is not None:
            self._wait(job, "the exchange in flight", apply=True)
        now = self._worker.submit(self._exchange_job_for_now(range(len(self._plan)), final=False, current=True))
        self._wait(now, "folding the progress of the queue's last batches", apply=True)

    def _due_fragments(self, span_s: float = 0.0) -> list[int]:
        """The fragments to exchange now, and the schedule moved past them (``session.schedule``);
        ``span_s``: in a group, the seconds since the previous word step, whose slots are all due."""
        assert self._schedule is not None
        return self._schedule.take(self._steps, span_s)

    def _progress(self, *, finished: bool) -> dict[str, Any]:
        elapsed, done = time.monotonic() - self._started, self._samples - self._samples_at_enter
        return {
            "learner": self.learner_id,
            "steps": self._steps,
            "samples": self._samples,
            "samples_per_s": done / elapsed if elapsed > 0 else 0.0,
            "units": None,
            "started": self._started_wall,
            "last_seen": time.time(),
            "finished": finished,
        }

    def _exchange_job_for_now(
        self, indices: range | list[int], *, final: bool, current: bool = False
    ) -> Callable[[], list[Merge]]:
        """The job folding ``indices`` now; ``current``: rank 0 of a sharded group claims every
        batch so far (the queue closing: the other ranks' next folds hold them all)."""
        plan, model, exchanger = self._plan, self.model, self._exchanger
        if self._ahead and (final or current):  # every fragment folds now: none takes a step twice
            self._ahead.reached(self._steps, plan, model, leaving=True)
        snapshots = [(i, plan.fragments[i].snapshot_into(self._buffers[i], model)) for i in indices]
        guard, presence, shards = self._guard, self._presence, self._shard_progress
        mark, units, since = guard.snapshot()  # the batches it holds; where, in unwritten units
        marked = None
        if shards is not None and self._registers and not (final or current):
            mark, units, marked = shards.safe(self._steps, mark, units)  # no more than every shard holds
        link = guard.link
        assert link is not None
        taken = time.monotonic()  # who counts in N is judged on this clock (members.SignsOfLife)
        totals = (self._steps, self._samples)
        # Progress is written once per round (and on leaving), not once per fragment.
        progress = self._progress(finished=final) if self._registers and (final or len(plan) - 1 in indices) else None

        watched = threading.Lock()  # the queue's guard and link see one fold at a time
        lanes = self._lanes
        width = lanes.for_job(len(snapshots), self._slot_s(taken))

        def before_write(listed: float) -> None:
            with watched:
                guard.before_write(listed)

        def job() -> None:
            presence.check()  # a freeze between the snapshot and now: another process may run it
            # Many marks (small units) go to one object, written before any fold names it.
            inline, marks = self._marks.inline_or_write(units)

            def fold(item: tuple[int, dict[str, Tensor]]) -> None:
                i, snapshot = item
                with watched:
                    guard.fold_started(since)  # frozen since the last step, units taken over? stop
                began = time.monotonic()
                merge = exchanger.exchange(
                    i, snapshot, totals, final, taken, inline, marks, marked, before_create=before_write
                )
                lanes.folded(time.monotonic() - began)
                with self._landed_lock:  # applied at the next step even if another fold fails
                    self._landed.append(merge)
                with watched:
                    if shards is not None:
                        shards.landed(i, totals[0])
                    link.landed(i, mark)

            parallel(fold, snapshots, lanes=width)  # the first error raised once all ended
            if final:
                exchanger.leave()
            if progress is not None:
                exchanger.put_progress(progress)

        return job

    def _slot_s(self, now: float) -> float:
        """Seconds between two fragments' folds: a slot of ``every``, or with ``every_steps`` the
        slot's steps at the pace stepped since the previous job (inf until one is known)."""
        schedule, paced = self._schedule, self._paced
        assert schedule is not None
        self._paced = (now, self._steps)
        if math.isfinite(schedule.slot_s) or paced is None or self._steps <= paced[1]:
            return schedule.slot_s
        return schedule.slot_steps * (now - paced[0]) / (self._steps - paced[1])

    def _apply(self, job: Job, what: str) -> None:
        """Apply what ``job``'s folds brought, then raise its error if it failed.

        The folds that landed before a failure (a later fragment's, or the progress record's
        write) are in the run: their merges are applied all the same, so a loop that catches the
        error and goes on stays exact (it counted a landed fold's progress twice otherwise).
        """
        with self._landed_lock:
            merges, self._landed = self._landed, []
        self._finish(merges)
        self._result(job, what)

    def _finish(self, merges: list[Merge]) -> None:
        """Apply finished fragment exchanges as deltas: local progress made meanwhile stays."""
        weights: dict[str, int] = {}
        for merge in merges:
            self._exchanges += 1
            merge.apply_to(self.model)
            if any(learner != self.learner_id for learner in merge.weights):
                self._merges += 1
            for learner, gained in merge.weights.items():
                weights[learner] = max(weights.get(learner, 0), gained)
        self._last_weights = weights
        what = "%s exchange %d: version %s, %d conflicts so far, samples folded %s"
        log.debug(what, self.learner_id, self._exchanges, self.version, self.conflicts, weights)

    def _result(self, job: Job, what: str) -> Any:
        if job.error is not None:
            raise surface(job.error, f"{what} of Session {self.learner_id!r} on {describe(self.mailbox)}")
        return job.result

    def _wait(self, job: Job, what: str, *, apply: bool = False) -> Any:
        """``job``'s result (``apply``: an exchange's, applied); a thread still busy past the
        timeout is stuck (left behind on exit)."""
        self._stuck = not job.done.wait(self._timeout_s) or self._stuck
        self._raise_if_running(job, what, self._timeout_s)
        if apply:
            return self._apply(job, what)
        return self._result(job, what)

    def _raise_if_running(self, job: Job, what: str, limit: float) -> None:
        if not job.done.is_set():
            raise SessionError(
                f"learner {self.learner_id!r}: {what} did not finish within {timedelta(seconds=limit)}; "
                f"the mailbox {describe(self.mailbox)} is slow or not answering"
            )


def _samples(value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError("samples must be an int, not bool")
    try:
        return int(value.__index__())
    except AttributeError:
        raise TypeError(f"samples must be an int, not {type(value).__name__}") from None
