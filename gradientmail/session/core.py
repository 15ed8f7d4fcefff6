"""``Session``: the training-thread side (``step``) and the one background exchange thread."""

from __future__ import annotations

import json
import math
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from gradientmail.errors import GradientMailError, MailRejectedError, SessionError
from gradientmail.layout import progress_key, session_prefix
from gradientmail.mailbox.base import Mailbox, describe
from gradientmail.mailbox.keys import validate_key
from gradientmail.session.mail import (
    MailHeader,
    Spec,
    encode,
    final_key,
    float_state,
    mail_key,
    parse_key,
    spec_of,
)
from gradientmail.session.merge import WeightedSum, average_latest, download, latest_keys, load_into

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
"""Environment variables that, when set, override the matching argument (seconds, or a step
count; ``none`` disables an interval), so an operator can retune a job without editing code."""

KEEP_MAIL = 2
"""Numbered mails kept per learner: a reader that listed the older one can still read it."""


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


@dataclass(frozen=True)
class _Merge:
    delta: dict[str, Tensor]  # theta_merged - theta_snapshot, per floating-point entry
    weights: dict[str, int]  # learner -> samples it counted with, this learner included


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
    """Asynchronous parameter exchange through a mailbox; see ``gradientmail.session``.

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
        max_staleness: a peer's mail older than this (by the sender's clock, at its snapshot)
            does not count: a silent or dead peer simply stops counting.
        timeout: the longest wait for the background thread on enter and exit.
        catch_up: on enter, load the sample-weighted average of every learner's newest mail
            (a late or restarted node joins the consensus instead of starting cold).

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
        every = _env_interval(ENV_EVERY, every)
        every_steps = _env_steps(every_steps)
        max_staleness = _env_interval(ENV_MAX_STALENESS, max_staleness)
        timeout = _env_interval(ENV_TIMEOUT, timeout)
        if every_steps is not None and (isinstance(every_steps, bool) or not isinstance(every_steps, int)
                                        or every_steps < 1):
            raise ValueError(f"every_steps must be None or an int >= 1, not {every_steps!r}")
        if every is None and every_steps is None:
            raise ValueError("every and every_steps are both None: the session would never exchange")
        self.model = model
        self.mailbox = mailbox
        self.learner_id = learner_id
        self.every = every
        self.every_steps = every_steps
        self.max_staleness = max_staleness
        self.timeout = timeout
        self.catch_up = catch_up
        self._every_s = _positive("every", every, optional=True)
        self._every_steps = math.inf if every_steps is None else every_steps
        self._max_staleness_s = _positive("max_staleness", max_staleness)
        self._timeout_s = _positive("timeout", timeout)

        self._state = "new"  # new -> active -> closed
        self._steps = 0
        self._samples = 0
        self._exchanges = 0
        self._merges = 0
        self._job: _Job | None = None
        self._stuck = False
        self._due_step: float = math.inf
        self._due_time: float = math.inf
        # Owned by the background thread once entered.
        self._spec: Spec = {}
        self._seq = 0
        self._own: deque[int] = deque()
        self._seen: dict[str, int] = {}
        self._finals: set[str] = set()
        self._last_weights: dict[str, int] = {}
        self._buffers: dict[str, Tensor] = {}  # the snapshot, reused from exchange to exchange

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
        """Exchanges completed (mailed, and peers' mail read) since enter."""
        return self._exchanges

    @property
    def merges(self) -> int:
        """Exchanges whose merge changed the model (at least one peer's mail counted)."""
        return self._merges

    @property
    def last_weights(self) -> dict[str, int]:
        """``{learner: samples}`` of the last merge applied, this learner included."""
        return dict(self._last_weights)

    @property
    def in_flight(self) -> bool:
        """True while a background exchange is running or its result awaits the next step."""
        return self._job is not None

    def __repr__(self) -> str:
        return (
            f"Session(learner_id={self.learner_id!r}, mailbox={describe(self.mailbox)}, "
            f"steps={self._steps}, samples={self._samples}, {self._state})"
        )

    # -- enter / exit ------------------------------------------------------------------------
    def __enter__(self) -> Session:
        if self._state != "new":
            raise SessionError(f"Session {self.learner_id!r} was already entered; create a new one")
        self._spec = spec_of(float_state(self.model))
        if not self._spec:
            raise ValueError("the model has no floating-point parameters or buffers to exchange")
        self._worker = _Worker(f"gradientmail-session-{self.learner_id}")
        self._started_wall = time.time()
        self._started = time.monotonic()
        try:
            average, own = self._wait(self._worker.submit(self._enter_job), "catching up on enter")
            if average is not None:
                load_into(self.model, average)
            if own is not None:  # a restarted learner continues its sequence and its totals
                self._seq = own.seq + 1
                self._steps = own.step
                self._samples = own.samples_total
        except BaseException:
            self._worker.close(0)
            raise
        self._samples_at_enter = self._samples
        self._mailed_samples = self._samples
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
                self._wait(self._worker.submit(self._final_job_for_now()), "mailing the final state")
            elif job is not None:
                # No final mail after a failed body (its last regular mail stays, as after a
                # crash); keep the body's exception and attach what happened in the background.
                note = None
                background = f"the background exchange of learner {self.learner_id!r}"
                if not job.done.wait(self._timeout_s):
                    self._stuck = True
                    note = f"{background} was still running after {self.timeout}"
                elif job.error is not None:
                    note = f"{background} had also failed: {job.error!r}"
                if note and hasattr(exc, "add_note"):
                    exc.add_note(note)
        finally:
            # An idle thread ends at once; a stuck one (a store that never answers) is a daemon
            # and is left behind rather than waited for again.
            self._worker.close(0 if self._stuck else self._timeout_s)
        return False

    # -- the training thread -----------------------------------------------------------------
    def step(self, samples: int) -> None:
        """Count one optimizer step and ``samples``; exchange in the background when due.

        ``samples`` (required: a node's weight in every merge is its samples) is what this step
        trained on, in any unit every node uses alike (sequences, tokens).

        Applies a finished merge here, at a step boundary, and raises any failure of the
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
            self._start_exchange()

    def wait(self, timeout: timedelta | None = None) -> None:
        """Wait for the exchange in flight, if any, and apply its merge now.

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

    def _header(self, *, final: bool = False) -> MailHeader:
        header = MailHeader(
            learner=self.learner_id,
            seq=self._seq,
            step=self._steps,
            samples_total=self._samples,
            samples_since_previous=self._samples - self._mailed_samples,
            time=time.time(),
            final=final,
        )
        self._seq += 1
        self._mailed_samples = self._samples
        return header

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

    def _start_exchange(self) -> None:
        snapshot = self._snapshot()
        header = self._header()
        progress = self._progress(finished=False)
        self._job = self._worker.submit(lambda: self._exchange_job(snapshot, header, progress))
        self._schedule()

    def _final_job_for_now(self) -> Callable[[], None]:
        snapshot = self._snapshot()
        header = self._header(final=True)
        progress = self._progress(finished=True)
        return lambda: self._final_job(snapshot, header, progress)

    def _finish(self, merge: _Merge | None) -> None:
        """Apply a finished exchange's merge as a delta: local progress since the snapshot stays."""
        self._exchanges += 1
        if merge is None:
            return
        live = float_state(self.model)
        with torch.no_grad():
            for name, delta in merge.delta.items():
                target = live[name]
                target.add_(delta.to(target.device))
        self._merges += 1
        self._last_weights = merge.weights

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
        wrapped = SessionError(
            f"{what} of learner {self.learner_id!r} failed: {type(error).__name__}: {error}"
        )
        wrapped.__cause__ = error
        return wrapped

    # -- the background thread -----------------------------------------------------------------
    def _enter_job(self) -> tuple[dict[str, Tensor] | None, MailHeader | None]:
        mailbox, me = self.mailbox, self.learner_id
        own = []
        has_final = False
        for key in mailbox.list(session_prefix(me)):
            parsed = parse_key(key)
            if parsed is not None and parsed[0] == me:
                if parsed[1] is None:
                    has_final = True
                else:
                    own.append(parsed[1])
        if self.catch_up:
            average, mails = average_latest(mailbox, self._spec)
        else:
            average, mails = None, {}
            newest = latest_keys(mailbox).get(me)
            mail = download(mailbox, newest[0], me, self._spec) if newest else None
            if mail is not None:
                mails[me] = mail
        for learner, mail in mails.items():
            if learner != me:
                self._seen[learner] = mail.header.seq
                if mail.header.final:
                    self._finals.add(learner)
        own_mail = mails.get(me)
        if has_final and own_mail is not None and own_mail.header.final:
            # Running again: the final state becomes ordinary numbered mail, so peers see our
            # next mail as newer and the state is never missing from the store.
            seq = own_mail.header.seq
            data = mailbox.get(final_key(me))
            if data is not None:
                mailbox.put(mail_key(me, seq), data)
                own.append(seq)
            mailbox.delete(final_key(me))
        self._own = deque(sorted(set(own)))
        return average, None if own_mail is None else own_mail.header

    def _exchange_job(self, snapshot: dict[str, Tensor], header: MailHeader,
                      progress: dict[str, Any]) -> _Merge | None:
        mailbox, me = self.mailbox, self.learner_id
        mailbox.put(mail_key(me, header.seq), encode(snapshot, header))
        self._own.append(header.seq)
        while len(self._own) > KEEP_MAIL:
            mailbox.delete(mail_key(me, self._own.popleft()))
        self._put_progress(progress)
        return self._merge_peers(snapshot, header)

    def _merge_peers(self, snapshot: Mapping[str, Tensor], header: MailHeader) -> _Merge | None:
        mailbox, me = self.mailbox, self.learner_id
        now = time.time()
        total = WeightedSum(self._spec, base=snapshot)
        weights: dict[str, int] = {}
        for learner, (key, seq) in latest_keys(mailbox).items():
            if learner == me:
                continue
            if seq is None:
                if learner in self._finals:
                    continue  # its final state was read already
            elif seq <= self._seen.get(learner, -1):
                continue  # nothing new from this peer
            else:
                self._finals.discard(learner)  # it is running again after finishing once
            try:
                mail = download(mailbox, key, learner, self._spec)
            except MailRejectedError:
                # Raised once at the next step(); the same mail is not read (or raised) again.
                if seq is None:
                    self._finals.add(learner)
                else:
                    self._seen[learner] = seq
                raise
            if mail is None:
                continue  # replaced since the listing; its successor counts next time
            previous = self._seen.get(learner, -1)
            self._seen[learner] = max(previous, mail.header.seq)
            if mail.header.final:
                self._finals.add(learner)
            if mail.header.seq <= previous:
                continue
            if now - mail.header.time > self._max_staleness_s:
                continue  # stale: a silent or dead peer stops counting
            if mail.header.samples_since_previous <= 0:
                continue
            total.add(mail.tensors, float(mail.header.samples_since_previous))
            weights[learner] = mail.header.samples_since_previous
        if not weights:
            return None
        weights[me] = header.samples_since_previous
        return _Merge(delta=total.result(extra_weight=float(header.samples_since_previous)), weights=weights)

    def _final_job(self, snapshot: dict[str, Tensor], header: MailHeader, progress: dict[str, Any]) -> None:
        mailbox, me = self.mailbox, self.learner_id
        mailbox.put(final_key(me), encode(snapshot, header))
        while self._own:
            mailbox.delete(mail_key(me, self._own.popleft()))
        self._put_progress(progress)

    def _put_progress(self, progress: dict[str, Any]) -> None:
        record = dict(progress, units=_units_claimed(self.learner_id))
        self.mailbox.put(progress_key(self.learner_id), json.dumps(record).encode())


def _samples(value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError("samples must be an int, not bool")
    try:
        return int(value.__index__())
    except AttributeError:
        raise TypeError(f"samples must be an int, not {type(value).__name__}") from None
