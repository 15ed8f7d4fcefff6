"""``Session``: the training-thread side (``step``) and the one background exchange thread."""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from gradientmail.errors import GradientMailError, SessionError
from gradientmail.layout import progress_key
from gradientmail.mailbox.base import Mailbox, describe
from gradientmail.mailbox.keys import validate_key
from gradientmail.session.chain import KEEP, active_learners, create_base, fold, read_newest
from gradientmail.session.mail import (
    Contribution,
    Spec,
    State,
    accumulation_dtype,
    float_state,
    member_key,
    spec_of,
)
from gradientmail.session.merge import load_into
from gradientmail.session.outer import OuterOptimizer, resolve_outer

log = logging.getLogger("gradientmail.session")
"""Joining and leaving at INFO, every exchange at DEBUG; the library never configures handlers."""

DEFAULT_EVERY = timedelta(seconds=30)
"""Exchange interval. Time (not steps) keeps every node's cadence equal whatever its speed, so a
fast node's mail carries proportionally more samples, and bounds store requests per node
(about 4 + peers per exchange) whatever the step time. 30 s leaves a model of a few hundred MB
time to travel to S3 and back before the next exchange is due."""

DEFAULT_MAX_STALENESS = timedelta(minutes=5)
"""Ten exchange intervals: a peer whose newest mail is older than this has stopped counting."""

DEFAULT_TIMEOUT = timedelta(minutes=5)
"""Longest wait for the background thread (catch-up on enter, last exchange and final mail on
exit) before a ``SessionError`` says the mailbox is not answering."""

ENV_EVERY = "GRADIENTMAIL_SESSION_EVERY_S"
ENV_EVERY_STEPS = "GRADIENTMAIL_SESSION_EVERY_STEPS"
ENV_MAX_STALENESS = "GRADIENTMAIL_SESSION_MAX_STALENESS_S"
ENV_TIMEOUT = "GRADIENTMAIL_SESSION_TIMEOUT_S"
ENV_OUTER = "GRADIENTMAIL_SESSION_OUTER"
"""Environment variables that, when set, override the matching argument (seconds, or a step
count; ``none`` disables an interval), so an operator can retune a job without editing code."""

KEEP_MAIL = KEEP
"""Versions of the run's state kept behind the newest (the old name, kept for imports)."""


def _env_interval(name: str, value: timedelta | None) -> timedelta | None:
    text = os.environ.get(name)
    if text is None or not text.strip():
        return value
    if text.strip().lower() == "none":
        return None
    try:
        return timedelta(seconds=float(text))
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected a number of seconds or 'none'") from None


def _env_steps(value: int | None) -> int | None:
    text = os.environ.get(ENV_EVERY_STEPS)
    if text is None or not text.strip():
        return value
    if text.strip().lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{ENV_EVERY_STEPS}={text!r}: expected a step count or 'none'") from None


def _positive(name: str, value: timedelta | None, *, optional: bool = False) -> float:
    if value is None and optional:
        return math.inf
    if not isinstance(value, timedelta):
        raise TypeError(f"{name} must be a datetime.timedelta, not {type(value).__name__}")
    seconds = value.total_seconds()
    if seconds <= 0:
        raise ValueError(f"{name} must be positive, not {value}")
    return seconds


def _units_claimed(learner_id: str) -> int | None:
    """Units this learner claimed, from the shared queue of this process when it has one."""
    try:
        from gradientmail.patterns.shared_queue import units_claimed_by
    except (ImportError, AttributeError):
        return None
    try:
        units = units_claimed_by(learner_id)
    except Exception:  # a status field must never fail an exchange
        return None
    if isinstance(units, bool):
        return None
    if isinstance(units, int):
        return units
    try:
        return len(units)
    except TypeError:
        return None


def _unit_spans(store: str, learner_id: str) -> dict[str, Any] | None:
    """The recent units' training spans timed by this process's shared queue (``gradientmail
    plot`` draws them), or None."""
    try:
        from gradientmail.patterns.unit_timing import spans_record

        return spans_record(store, learner_id)
    except Exception:  # a display aid must never fail an exchange
        return None


@dataclass(frozen=True)
class _Merge:
    delta: dict[str, Tensor]  # the run's state after this fold - the snapshot, per entry
    weights: dict[str, int]  # learner -> samples newly folded into the run, this learner included


class _Job:
    """One unit of background work; the training thread polls ``done`` (an ``Event``)."""

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


class _Worker:
    """The one background thread of a session; runs jobs one at a time, in order."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        # Daemon: a store that never answers must not keep the interpreter alive at exit; every
        # wait on this thread is bounded by the session's timeout instead.
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            job.run()

    def submit(self, fn: Callable[[], Any]) -> _Job:
        job = _Job(fn)
        self._jobs.put(job)
        return job

    def close(self, timeout: float) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)


class Session:
    """Asynchronous exchange of training progress through a mailbox; see ``gradientmail.session``.

    Args:
        model: the ``torch.nn.Module`` being trained; its floating-point ``state_dict`` entries
            are exchanged.
        mailbox: any object with the ``Mailbox`` methods, the same store for every node.
        learner_id: this node's name, one key segment (``node-3``), unique in the run.
        every: exchange when this much time has passed since the previous exchange began.
            ``None`` to exchange by steps only.
        every_steps: exchange when this many ``step()`` calls have passed since the previous
            exchange began; ``None`` (default) to exchange by time only. With both, whichever
            is due first.
        max_staleness: a member that has neither joined nor folded progress for this long (by
            its own clock) no longer counts in ``N``: a silent or dead node stops counting.
        timeout: the longest wait for the background thread on enter and exit.
        catch_up: on enter, load the run's state (a late or restarted node joins the run
            instead of starting cold). The first node's model becomes the run's base.
        outer: the outer optimizer: ``"delayed_nesterov"`` (default, measured best: progress / N
            plus a momentum step every 4 folds) or ``"average"`` (progress / N only), or an
            ``OuterOptimizer`` such as ``DelayedNesterov(lr=0.5)``.
        wire_dtype: the dtype the run's state is stored in: ``None`` (float32; float64 for a
            float64 model) or ``torch.bfloat16`` (half the bytes, stochastically rounded).

    Environment variables ``GRADIENTMAIL_SESSION_EVERY_S``, ``..._EVERY_STEPS``,
    ``..._MAX_STALENESS_S`` and ``..._TIMEOUT_S`` override the arguments when set.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        mailbox: Mailbox,
        learner_id: str,
        every: timedelta | None = DEFAULT_EVERY,
        every_steps: int | None = None,
        max_staleness: timedelta = DEFAULT_MAX_STALENESS,
        timeout: timedelta = DEFAULT_TIMEOUT,
        catch_up: bool = True,
        outer: str | OuterOptimizer = "delayed_nesterov",
        wire_dtype: torch.dtype | None = None,
    ) -> None:
        if not callable(getattr(model, "state_dict", None)):
            raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
        if not isinstance(mailbox, Mailbox):
            raise TypeError(
                f"mailbox must have the Mailbox methods (put_if_absent, get, put, list, delete); "
                f"got {type(mailbox).__name__}"
            )
        if not isinstance(learner_id, str) or "/" in learner_id:
            raise ValueError(f"learner_id must be one key segment without '/', not {learner_id!r}")
        validate_key(progress_key(learner_id))
        validate_key(member_key(learner_id, 0.0))
        every = _env_interval(ENV_EVERY, every)
        every_steps = _env_steps(every_steps)
        max_staleness = _env_interval(ENV_MAX_STALENESS, max_staleness)
        timeout = _env_interval(ENV_TIMEOUT, timeout)
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
        self._every_s = _positive("every", every, optional=True)
        self._every_steps = math.inf if every_steps is None else every_steps
        self._max_staleness_s = _positive("max_staleness", max_staleness)
        self._timeout_s = _positive("timeout", timeout)

        self._state = "new"  # new -> active -> closed
        self._steps = 0
        self._samples = 0
        self._seq = 0
        self._exchanges = 0
        self._merges = 0
        self._conflicts = 0
        self._job: _Job | None = None
        self._stuck = False
        self._due_step: float = math.inf
        self._due_time: float = math.inf
        self._last_weights: dict[str, int] = {}
        self._buffers: dict[str, Tensor] = {}  # the snapshot, reused from exchange to exchange
        # Owned by the background thread once entered.
        self._spec: Spec = {}
        self._known: State | None = None  # the newest version of the run's state this node holds
        self._anchor: dict[str, Tensor] = {}  # where this node's local progress is measured from
        self._member: str | None = None
        self._active = 1  # N when the previous fold (or joining) happened
        self._outer_state = self.outer.start()

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
        """Exchanges completed (progress folded into the run's state) since enter."""
        return self._exchanges

    @property
    def merges(self) -> int:
        """Exchanges that brought in progress of at least one other learner."""
        return self._merges

    @property
    def conflicts(self) -> int:
        """Versions of the run's state lost to other writers (each cost one more read)."""
        return self._conflicts

    @property
    def version(self) -> int | None:
        """The version of the run's state this node last read or wrote."""
        known = self._known
        return None if known is None else known.header.version

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
        entries = float_state(self.model)
        self._spec = spec_of(entries, self.wire_dtype)
        if not self._spec:
            raise ValueError("the model has no floating-point parameters or buffers to exchange")
        initial = {
            name: tensor.detach().to(
                "cpu", torch.float64 if tensor.dtype == torch.float64 else torch.float32, copy=True
            )
            for name, tensor in entries.items()
        }
        self._worker = _Worker(f"gradientmail-session-{self.learner_id}")
        self._started_wall = time.time()
        self._started = time.monotonic()
        try:
            state, own = self._wait(self._worker.submit(lambda: self._enter_job(initial)), "joining the run")
            if self.catch_up:
                load_into(self.model, state.tensors)
            if own is not None:  # a restarted learner continues its sequence and its totals
                self._seq = own.seq + 1
                self._steps = own.step
                self._samples = own.samples
        except BaseException:
            self._worker.close(0)
            raise
        self._samples_at_enter = self._samples
        # A first progress record, so that `gradientmail status` lists this
        # learner from the start rather than from its first exchange.
        progress = self._progress(finished=False)
        try:
            self._wait(self._worker.submit(lambda: self._put_progress(progress)), "writing progress")
        except BaseException:
            self._worker.close(0)
            raise
        self._schedule()
        self._state = "active"
        log.info(
            "%s joined the run on %s at version %s (%s, outer %s)",
            self.learner_id,
            describe(self.mailbox),
            self.version,
            "caught up" if self.catch_up else "own parameters",
            self.outer.name,
        )
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._state != "active":
            return False
        self._state = "closed"
        job, self._job = self._job, None
        try:
            if exc is None:
                if job is not None:
                    self._finish(self._wait(job, "the last exchange"))
                self._finish(
                    self._wait(
                        self._worker.submit(self._exchange_job_for_now(final=True)), "folding the final progress"
                    )
                )
                log.info(
                    "%s left the run at version %s after %d steps, %d exchanges, %d conflicts",
                    self.learner_id,
                    self.version,
                    self._steps,
                    self._exchanges,
                    self._conflicts,
                )
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
                    self._worker.submit(self._leave).done.wait(self._timeout_s)
        finally:
            # An idle thread ends at once; a stuck one (a store that never answers) is a daemon
            # and is left behind rather than waited for again.
            self._worker.close(0 if self._stuck else self._timeout_s)
        return False

    # -- the training thread -----------------------------------------------------------------
    def step(self, samples: int) -> None:
        """Count one optimizer step and ``samples``; exchange in the background when due.

        ``samples`` is what this step trained on, in any unit every node uses alike (sequences,
        tokens); it is reported in progress records and in the run's state.

        Applies a finished exchange here, at a step boundary, and raises any failure of the
        background exchange (``MailRejectedError``, ``MailboxError``, or ``SessionError``
        wrapping anything else). When nothing is due and nothing has finished this is a few
        attribute reads.
        """
        if self._state != "active":
            raise SessionError(f"Session {self.learner_id!r}: call step() inside `with session:`")
        if samples.__class__ is not int:
            samples = _samples(samples)
        if samples < 0:
            raise ValueError(f"samples must be >= 0, not {samples}")
        self._steps += 1
        self._samples += samples
        job = self._job
        if job is not None:
            if not job.done.is_set():
                return
            self._job = None
            self._finish(self._result(job, "a background exchange"))
        if self._steps >= self._due_step or time.monotonic() >= self._due_time:
            self._job = self._worker.submit(self._exchange_job_for_now(final=False))
            self._schedule()

    def wait(self, timeout: timedelta | None = None) -> None:
        """Wait for the exchange in flight, if any, and apply it now.

        For tests and for a consistent state before evaluation or a checkpoint. Raises what
        ``step()`` would raise, or ``SessionError`` after ``timeout`` (default: the session's).
        """
        if self._state != "active":
            raise SessionError(f"Session {self.learner_id!r}: call wait() inside `with session:`")
        job = self._job
        if job is not None:
            limit = self._timeout_s if timeout is None else _positive("timeout", timeout)
            if not job.done.wait(limit):
                # Still in flight (and still owning the snapshot): a later step() or wait()
                # picks it up; no new exchange starts meanwhile.
                raise SessionError(
                    f"learner {self.learner_id!r}: the exchange in flight did not finish within "
                    f"{timedelta(seconds=limit)}; the mailbox {describe(self.mailbox)} is slow or "
                    "not answering"
                )
            self._job = None
            self._finish(self._result(job, "the exchange in flight"))

    def _schedule(self) -> None:
        self._due_step = self._steps + self._every_steps
        self._due_time = time.monotonic() + self._every_s

    def _snapshot(self) -> dict[str, Tensor]:
        """The model's floating-point entries copied to the CPU, into reused buffers.

        Only called with no exchange in flight, so the previous snapshot is free to overwrite;
        reusing it avoids fresh (page-faulting) allocations, which cost more than the copy.
        """
        buffers = self._buffers
        for name, tensor in float_state(self.model).items():
            buffer = buffers.get(name)
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                pin = tensor.device.type == "cuda"  # page-locked: a faster copy from the GPU
                buffer = buffers[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
            buffer.copy_(tensor.detach())
        return buffers

    def _progress(self, *, finished: bool) -> dict[str, Any]:
        now = time.time()
        elapsed = time.monotonic() - self._started
        done = self._samples - self._samples_at_enter
        return {
            "learner": self.learner_id,
            "steps": self._steps,
            "samples": self._samples,
            "samples_per_s": done / elapsed if elapsed > 0 else 0.0,
            "units": None,
            "started": self._started_wall,
            "last_seen": now,
            "finished": finished,
        }

    def _exchange_job_for_now(self, *, final: bool) -> Callable[[], _Merge]:
        snapshot = self._snapshot()
        totals = (self._seq, self._steps, self._samples)
        self._seq += 1
        progress = self._progress(finished=final)
        return lambda: self._exchange_job(snapshot, totals, progress, final)

    def _finish(self, merge: _Merge) -> None:
        """Apply a finished exchange as a delta: local progress made meanwhile stays."""
        self._exchanges += 1
        live = float_state(self.model)
        with torch.no_grad():
            for name, delta in merge.delta.items():
                target = live[name]
                target.add_(delta.to(device=target.device, dtype=target.dtype))
        if any(learner != self.learner_id for learner in merge.weights):
            self._merges += 1
        self._last_weights = merge.weights
        log.debug(
            "%s exchange %d: version %s, %d conflicts so far, samples folded %s",
            self.learner_id,
            self._exchanges,
            self.version,
            self._conflicts,
            merge.weights,
        )

    def _result(self, job: _Job, what: str) -> Any:
        if job.error is not None:
            raise self._surface(job.error, what)
        return job.result

    def _wait(self, job: _Job, what: str, limit: float | None = None) -> Any:
        limit = self._timeout_s if limit is None else limit
        if not job.done.wait(limit):
            self._stuck = True
            raise SessionError(
                f"learner {self.learner_id!r}: {what} did not finish within {timedelta(seconds=limit)}; "
                f"the mailbox {describe(self.mailbox)} is not answering"
            )
        return self._result(job, what)

    def _surface(self, error: BaseException, what: str) -> BaseException:
        where = f"raised by {what} of Session {self.learner_id!r} on {describe(self.mailbox)}"
        if isinstance(error, GradientMailError):
            if hasattr(error, "add_note") and where not in getattr(error, "__notes__", ()):
                error.add_note(where)
            return error
        wrapped = SessionError(f"{what} of learner {self.learner_id!r} failed: {type(error).__name__}: {error}")
        wrapped.__cause__ = error
        return wrapped

    # -- the background thread -----------------------------------------------------------------
    def _enter_job(self, initial: dict[str, Tensor]) -> tuple[State, Contribution | None]:
        """Join the run: its newest state (creating the base if there is none) and a member key."""
        mailbox, me = self.mailbox, self.learner_id
        state, listing = read_newest(mailbox, self._spec)
        if state is None:
            state = create_base(mailbox, self._spec, initial, me)
        self._member = member_key(me, time.time())
        mailbox.put(self._member, json.dumps({"learner": me, "joined": time.time()}).encode())
        for key in listing.member_keys.get(me, []):  # an earlier incarnation's, if any
            if key != self._member:
                mailbox.delete(key)
        self._known = state
        self._anchor = _widen(state.tensors) if self.catch_up else initial
        self._active = len(active_learners(listing, state.header, me, time.time(), self._max_staleness_s))
        return state, state.header.learners.get(me)

    def _exchange_job(
        self, snapshot: dict[str, Tensor], totals: tuple[int, int, int], progress: dict[str, Any], final: bool
    ) -> _Merge:
        mailbox, me = self.mailbox, self.learner_id
        seq, steps, samples = totals
        anchor = self._anchor
        local = {name: snapshot[name].to(anchor[name].dtype) - anchor[name] for name in anchor}
        for name, tensor in local.items():  # never spread a diverged model to every node
            if not bool(torch.isfinite(tensor).all()):
                raise SessionError(
                    f"learner {me!r}: this node's own parameters hold NaN or Inf in {name!r} "
                    "(local training diverged: lower the learning rate, clip gradients); nothing "
                    "was folded into the run, whose state stays finite"
                )
        wire = self.wire_dtype

        def add(base: Mapping[str, Tensor], increment: Mapping[str, Tensor]) -> dict[str, Tensor]:
            return {name: _to_wire(base[name].to(increment[name].dtype) + increment[name], wire) for name in increment}

        done = fold(
            mailbox,
            self._spec,
            me=me,
            known=self._known,
            increment_for=lambda active: self._outer_state(local, self._scale_for(active)),
            entry=lambda header: Contribution(seq=seq, step=steps, samples=samples, time=time.time(), final=final),
            add=add,
            max_staleness=self._max_staleness_s,
            deadline=time.monotonic() + self._timeout_s,
        )
        self._conflicts += done.conflicts
        before = self._known.header.learners if self._known is not None else {}
        self._known = done.state
        self._anchor = _widen(done.state.tensors)
        delta = {name: self._anchor[name] - snapshot[name].to(self._anchor[name].dtype) for name in self._anchor}
        weights = {}
        for learner, entry in done.state.header.learners.items():
            old = before.get(learner)
            gained = entry.samples - (old.samples if old is not None else 0)
            if gained > 0 or (learner == me and gained >= 0):
                weights[learner] = gained
        if final:
            self._leave()
        self._put_progress(progress)
        return _Merge(delta=delta, weights=weights)

    def _scale_for(self, active: int) -> int:
        """``N`` for progress made since the previous fold: the larger of then and now.

        Progress made while four learners ran still counts 1/4 when the others have left by the
        time it is folded (a learner's last progress, at exit), and a learner that just joined
        does not yet inflate the others' contributions: the rule never overshoots.
        """
        scale = max(active, self._active)
        self._active = active
        return scale

    def _leave(self) -> None:
        if self._member is not None:
            self.mailbox.delete(self._member)
            self._member = None

    def _put_progress(self, progress: dict[str, Any]) -> None:
        record = dict(progress, units=_units_claimed(self.learner_id))
        spans = _unit_spans(describe(self.mailbox), self.learner_id)
        if spans is not None:  # when and for how long this learner trained its recent units
            record["unit_spans"] = spans
        self.mailbox.put(progress_key(self.learner_id), json.dumps(record).encode())


def _widen(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Tensors as stored, in the dtype sums are taken in (float32, or float64 as it is)."""
    return {name: t.to(accumulation_dtype(t.dtype)) for name, t in tensors.items()}


def _to_wire(tensor: Tensor, wire: torch.dtype | None) -> Tensor:
    """``tensor`` in the dtype it is stored in; bfloat16 is rounded stochastically (unbiased).

    Round-to-nearest would drop every contribution smaller than half a bfloat16 step of the
    weight; adding random low bits before truncating keeps each one in expectation.
    """
    if wire is None or wire == tensor.dtype:
        return tensor
    if wire == torch.bfloat16 and tensor.dtype == torch.float32:
        bits = tensor.contiguous().view(torch.int32)
        noise = torch.randint(0, 1 << 16, tensor.shape, dtype=torch.int32)
        return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)
    return tensor.to(wire)


def _samples(value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError("samples must be an int, not bool")
    try:
        return int(value.__index__())
    except AttributeError:
        raise TypeError(f"samples must be an int, not {type(value).__name__}") from None
